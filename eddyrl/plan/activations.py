"""What autograd keeps of one decoder layer, per token: derived from the layer's ops.

Each tensor below is one that transformers' Qwen3 / Llama decoder layer creates and an autograd
node saves for the backward (torch saves an op's input only where an input gradient's formula
needs it: `a * b` keeps `b` for `a`'s gradient and `a` only if `b` requires a gradient; a
linear keeps its input only for its weight's gradient; a view, an add, `.to()` and a copy keep
nothing). A tensor saved by several nodes is one storage, counted once. With the hidden size H,
q = heads x head_dim, kv = kv_heads x head_dim, I the MLP width, c the compute dtype's bytes:

  RMSNorm (x2 per layer, and q_norm/k_norm per head on Qwen3): the input in fp32 (a copy when
    c < 4, the input itself in fp32) kept by `pow` and by `* rsqrt`; the rsqrt [tokens, 1] fp32;
    the normalised `.to(c)` kept by `weight * y` (for the weight's gradient); the output, kept
    by the next linears (for their weights' gradients).
  Rotary: `q * cos + rotate_half(q) * sin` keeps only cos/sin (shared by all layers, counted
    once in the root); its result is the attention kernel's input.
  Attention, fused kernel (sdpa's flash / memory-efficient, flash-attn, Ascend's fused): keeps
    q, k, v, its output and the log-sum-exp [heads] fp32. The output comes back as
    [tokens, heads, dim], so the transpose back and `.contiguous()` before o_proj is free and
    o_proj keeps that same storage. Without a mask GQA runs natively (k, v at kv width); with
    a custom mask transformers first repeats k and v to all heads (`repeat_kv`, a copy), and
    those copies are what the kernel keeps; and torch's sdpa turns the bool mask into an
    additive one in the compute dtype (`convert_boolean_attn_mask`) in every layer's call, and
    the kernel keeps that copy: [S, S] x c per row per layer, S x c per token.
  Attention, eager: the matmuls keep q and the repeated k, v; the softmax keeps its fp32
    probabilities [heads, S] per token (and their `.to(c)` copy when c < 4) - O(S^2) a row;
    the output's contiguous copy is o_proj's input.
  MLP (SwiGLU): gate (kept by silu), act and up (kept by `act * up`), and `act * up` (kept by
    down_proj): 4 x I.

`tests/integration/plan/test_saved_activations.py` checks this sum against what torch's saved-tensor hooks
see in a transformers Qwen3 layer (fp32, bf16, sdpa and eager): equal to the byte.

LoRA: a frozen linear keeps no input (no weight gradient to compute), an adapted one keeps its
input for lora_A and lora_A's [rank] output for lora_B (plus a dropout copy and mask when the
adapter's dropout > 0); a frozen RMSNorm weight drops the normalised copy.

MoE layers (Qwen3-MoE) are estimated from the same rules, not measured here: the router's input
and fp32 logits and probabilities [experts], and each of the top-k experts' SwiGLU on its copy
of the token (H + 4 x moe_I per routed copy).
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape

FP32 = 4
ATTENTION_KINDS = ("mask", "varlen", "flash", "eager")


@dataclass(frozen=True)
class LayerTraining:
    """Which of a layer's weights train (LoRA freezes the base, adapts `lora_targets`)."""

    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: bool = False

    def saves_input(self, linear: str) -> bool:
        """Whether the linear named `linear` keeps its input (for a weight or adapter grad)."""
        return not self.lora_rank or linear in self.lora_targets

    @property
    def norms_train(self) -> bool:
        return not self.lora_rank


def _norm(width: int, rows: int, c: int, train: LayerTraining, output_kept: bool) -> int:
    """RMSNorm over `width` elements, `rows` rsqrt values, per token (module docstring)."""
    kept = width * FP32 + rows * FP32
    if train.norms_train:
        kept += width * c
    if output_kept:
        kept += width * c
    return kept


def _lora(width_in: int, rank: int, c: int, dropout: bool) -> int:
    return rank * c + (width_in * (c + 1) if dropout else 0)


def layer_bytes_per_token(shape: ModelShape, c: int, attention: str, sequence: int,
                          train: LayerTraining = LayerTraining(), index: int = 0) -> int:
    """Bytes autograd keeps per token for decoder layer `index`; `sequence`: tokens per
    attention row (only eager attention's probabilities depend on it)."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention = {attention!r}: must be one of {ATTENTION_KINDS}")
    h, q, kv = shape.hidden, shape.q_width, shape.kv_width
    qkv_in = any(train.saves_input(n) for n in ("q_proj", "k_proj", "v_proj"))
    kept = _norm(h, 1, c, train, qkv_in)
    if shape.qk_norm:  # the projections' outputs go through q_norm / k_norm first
        kept += _norm(q, shape.heads, c, train, False) + _norm(kv, shape.kv_heads, c, train, False)
    if attention == "eager":
        repeated = 2 * q * c  # repeat_kv copies of k and v, kept by the two matmuls
        probs = shape.heads * sequence * (FP32 + (c if c < FP32 else 0))
        kept += q * c + repeated + probs + (q * c if train.saves_input("o_proj") else 0)
    else:
        k_v = 2 * q * c if attention == "mask" and shape.kv_heads != shape.heads else 2 * kv * c
        kept += q * c + k_v + q * c + shape.heads * FP32  # q, k, v, output, log-sum-exp
        if attention == "mask":  # each layer's additive copy of the bool mask: [S, S] x c
            kept += sequence * c
    kept += _norm(h, 1, c, train, any(train.saves_input(n) for n in ("gate_proj", "up_proj")))
    if shape.is_moe_layer(index):
        k, width = shape.experts_per_token, shape.moe_intermediate
        kept += 2 * shape.num_experts * FP32 + k * (h + 4 * width) * c
    else:
        width = shape.intermediate
        kept += 3 * width * c + (width * c if train.saves_input("down_proj") else 0)
    if train.lora_rank:
        widths = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": q, "gate_proj": h,
                  "up_proj": h, "down_proj": shape.intermediate}
        kept += sum(_lora(widths[t], train.lora_rank, c, train.lora_dropout)
                    for t in train.lora_targets if t in widths)
    return kept


def checkpointed_bytes_per_token(shape: ModelShape, c: int, kind: str) -> int:
    """What a checkpointed layer keeps per token until its backward: its input (both kinds);
    `selective` also keeps the attention kernel's outputs (output and log-sum-exp), so the
    recompute skips the attention."""
    kept = shape.hidden * c
    if kind == "selective":
        kept += shape.q_width * c + shape.heads * FP32
    return kept


def backward_working_bytes_per_token(shape: ModelShape, c: int) -> int:
    """The gradients alive inside one layer's backward at its widest point, the MLP, over the
    layer's saved tensors: the gradient of `act * up` and those of act and up that its
    backward makes (3 x I), less `act * up` itself, which down_proj's backward released
    (net 2 x I), beside the gradients flowing in and out of the layer (2 x H)."""
    width = shape.moe_intermediate * shape.experts_per_token if shape.num_experts else 0
    return 2 * max(shape.intermediate, width) * c + 2 * shape.hidden * c

"""The memory one rollout engine holds on its device, from the model's shape and the engine's
settings, with no device and no weights: its weights, its KV cache and the workspace of one
forward step. Plain arithmetic, no I/O.

What each engine asks for is read from the engine adapters, not from vLLM's defaults:

- `vllm` (engines/inference/vllm/engine.py, api.py `kv_cache_args`): weights and KV cache in
  `rollout.dtype`, started with a context of `max_model_len` (the run's longest sequence,
  within the model's positions). Its KV cache is one pool of blocks, sized one of two ways:
  exactly (`rollout.memory_fraction` 0): `kv_cache_memory_bytes` = `kv_cache_bytes_for(config,
  max_batch_size, max_model_len, dtype)`, room for `rollout.max_batch_size` sequences at
  `max_model_len`, asked for whatever the device holds; or by a share of the device
  (`memory_fraction`, vLLM's `gpu_memory_utilization`): the engine takes that share of the
  device's memory and pools what its weights and workspace leave, KV tokens = fraction x device
  - weights - workspace. Either way `concurrent_sequences` is how many sequences of the run's
  longest length (prompt + response) the pool holds at once (vLLM still runs at most
  `max_batch_size`; shorter ones share it further, each holding the blocks it has filled).
  vLLM refuses to start when the pool holds less than one sequence of `max_model_len`
  (`RolloutMemory.short`).
- `hf` (engines/inference/hf.py): weights in `rollout.dtype`; a KV cache that grows with the
  batch, at most `max_batch_size` sequences of the run's longest length.

The workspace is an estimate, the largest transient of one forward step: one decoder layer's
intermediate tensors over a scheduler step's tokens (`STEP_TOKENS` for vLLM, the longest prompt
batch for hf), and the sampler's float32 logits (and their softmax) over the vocabulary for
every sequence of the batch. Not modelled: the device runtime's own context and the collective
library's buffers (a few hundred MB; the plan's reserve covers them).

Tensor parallelism (`tensor_parallel` > 1: one engine instance over that many devices, as the
simulator's scenarios run vLLM; Eddy's own engines use one device each): what one device of the
instance holds, as vLLM partitions a decoder (vllm/model_executor/layers/linear.py and
vocab_parallel_embedding.py; vllm/model_executor/models/qwen2.py and qwen3.py): every linear,
the embeddings and the LM head split over the devices, the norms whole on each; each device
computes and caches the K and V of its own `max(1, kv_heads // tp)` KV heads (vLLM replicates
a KV head, and its k and v projections, where tp exceeds their number), so the pool's tokens
are the instance's; the workspace's per-head and MLP widths split, the hidden-wide tensors
whole, and the logits gathered whole over the vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .shapes import ModelShape

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
# The engines' default (`rollout.dtype`): float32 weights and cache.
VLLM_DTYPE = "float32"
# vLLM rounds the KV cache to whole blocks: the adapter's `kv_cache_bytes_for` sizes by 256.
KV_BLOCK_TOKENS = 256
# Tokens of one vLLM scheduler step (its max_num_batched_tokens default is 2,048 to 16,384 by
# device and usage; 8,192 is the middle of that range).
STEP_TOKENS = 8192


@dataclass(frozen=True, kw_only=True)
class RolloutOptions:
    engine: str  # "vllm" | "hf" (an engine not modelled is planned as vllm)
    max_batch_size: int  # sequences one worker decodes together
    longest: int  # the run's longest sequence: max_prompt_tokens + max_new_tokens
    prompt_tokens: int  # the longest prompt (hf's prefill)
    max_model_len: int  # the context the engine is started with: the longest, within positions
    dtype: str = VLLM_DTYPE
    memory_fraction: float = 0.0  # vllm: 0 sizes the KV cache exactly; else a device share
    device_bytes: int = 0  # the device's whole memory (what memory_fraction is a share of)
    tensor_parallel: int = 1  # devices of one engine instance (module docstring)

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel = {self.tensor_parallel!r}: must be >= 1")


@dataclass(frozen=True)
class RolloutMemory:
    """Bytes one rollout engine holds on its device."""

    weights: int
    kv_cache: int
    workspace: int
    kv_tokens: int  # tokens the KV cache holds
    concurrent_sequences: int  # sequences of the run's longest length it holds at once
    # bytes the engine's share of the device lacks for its weights, workspace and one sequence
    # of max_model_len (vLLM then refuses to start); 0 when it has them
    short: int = 0

    @property
    def peak(self) -> int:
        return self.weights + self.kv_cache + self.workspace

    def terms(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "workspace": self.workspace}

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "peak": self.peak}


def kv_heads_per_device(shape: ModelShape, tp: int = 1) -> int:
    """The KV heads one device of a tp-wide instance caches (vLLM: max(1, kv_heads // tp))."""
    return max(1, shape.kv_heads // tp)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tp: int = 1) -> int:
    """K and V of every layer for one token, on one device of a tp-wide instance."""
    return 2 * shape.layers * kv_heads_per_device(shape, tp) * shape.head_dim * dtype_bytes


def weight_parameters_per_device(shape: ModelShape, tp: int = 1) -> int:
    """Parameters on one device of a tp-wide instance: the split ones' share, the norms whole,
    and the k and v projections of the device's own KV heads (replicated where tp exceeds
    their number)."""
    whole = shape.norm_parameters()
    kv = shape.layers * shape.kv_projection_parameters()
    split = shape.parameters() - whole - kv
    own_kv = shape.layers * shape.kv_projection_parameters(kv_heads_per_device(shape, tp))
    return -(-split // tp) + whole + own_kv


def _layer_width(shape: ModelShape, tp: int = 1) -> int:
    """Elements per token of one decoder layer's intermediates alive at once on one device: q,
    k, v, the attention output, and the MLP's gate, up and their product (the routed experts'
    for MoE), the per-head and MLP widths split over a tp-wide instance."""
    mlp = shape.moe_intermediate * shape.experts_per_token if shape.num_experts \
        else shape.intermediate
    heads = -(-shape.heads // tp) + 2 * kv_heads_per_device(shape, tp)
    return heads * shape.head_dim + 2 * shape.hidden + 3 * -(-mlp // tp)


def _blocks(tokens: int) -> int:
    """`tokens` rounded up to whole KV blocks."""
    return -(-tokens // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS


def rollout_memory(shape: ModelShape, options: RolloutOptions) -> RolloutMemory:
    size, tp = DTYPE_BYTES[options.dtype], options.tensor_parallel
    per_token = kv_bytes_per_token(shape, size, tp)
    weights = weight_parameters_per_device(shape, tp) * size
    pooled = options.engine != "hf" and options.memory_fraction > 0
    if options.engine == "hf":
        kv_tokens = options.max_batch_size * options.longest
        step_tokens = options.max_batch_size * options.prompt_tokens
    else:
        kv_tokens = options.max_batch_size * _blocks(options.max_model_len)
        step_tokens = STEP_TOKENS
    logits = 2 * options.max_batch_size * shape.vocab * 4  # float32 logits and their softmax
    workspace = step_tokens * _layer_width(shape, tp) * size + logits
    short = 0
    if pooled:  # what the share leaves after the weights and workspace, in whole blocks
        share = int(options.memory_fraction * options.device_bytes)
        pool = max(0, share - weights - workspace) // per_token
        kv_tokens = pool // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
        one = _blocks(options.max_model_len)  # vLLM's least: one sequence of its context
        short = max(0, weights + workspace + one * per_token - share)
        if kv_tokens < one:
            kv_tokens = one  # what it would need: the plan shows that peak
        kv_cache = max(kv_tokens * per_token, share - weights - workspace)
    else:
        kv_cache = kv_tokens * per_token
    return RolloutMemory(weights=weights, kv_cache=kv_cache, workspace=workspace,
                         kv_tokens=kv_tokens,
                         concurrent_sequences=kv_tokens // max(options.longest, 1), short=short)

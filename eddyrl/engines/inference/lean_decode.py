"""The `hf` engine's decode step for Llama-family models, op by op on the model's own weights.

A decode step of a small model on a CPU is mostly Python: transformers' forward goes through
each module's `__call__`, builds the attention mask, the cache's bookkeeping and an output
object at every step. This runs the same kernels in the same order on the same parameters
(`Qwen3` / `Qwen2` / `Llama` as transformers 5 writes them: RMSNorm, rotary embedding, grouped
query attention through SDPA, a SiLU-gated MLP) without that: measured on the default run's
batches, 5.4 -> 4.2 ms a step with 8 rows left and 8.7 -> 6.9 ms with 48, logits bit for bit
the same. `LeanDecoder.for_model` takes a model only when its config is one this reproduces,
and the engine checks one decode step of it against transformers' own at start
(`matches_transformers`): any difference and it keeps transformers' forward (with a warning),
so a transformers release that changes its modelling code costs speed, never correctness.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_FAMILIES = ("qwen3", "qwen2", "llama")


class LeanDecoder:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.inner = model.model
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.gqa = config.num_key_value_heads != config.num_attention_heads

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "LeanDecoder | None":
        """A decoder for `model`, or None when its config is outside what this reproduces."""
        config = model.config
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if (config.model_type not in _FAMILIES or rope != "default"
                or layer_types != {"full_attention"}
                or getattr(config, "use_sliding_window", False)
                or config.hidden_act != "silu"
                or getattr(config, "mlp_bias", False)
                or getattr(config, "pretraining_tp", 1) != 1
                or getattr(config, "_attn_implementation", None) != "sdpa"):
            return None
        return cls(model)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 cache) -> torch.Tensor:
        """Logits [B, V] of one new token per row: `ids`, `positions` [B, 1]; `mask` [B, L]
        the padding mask over the cache and the new position; `cache` transformers'."""
        batch, length = ids.shape
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        attend = mask.bool()[:, None, None, :]
        for index, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            # norms through their own `forward` (no module-call overhead): a platform's fused
            # kernel patched onto them (`Platform.apply_model_patches`) still runs
            h = layer.input_layernorm.forward(x)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias)
            q = q.view(batch, length, -1, self.head_dim)
            k = k.view(batch, length, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's queries and keys
                q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(batch, length, -1, self.head_dim).transpose(1, 2)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            k, v = cache.update(k, v, index)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=attn.scaling,
                                                 enable_gqa=self.gqa)
            out = out.transpose(1, 2).reshape(batch, length, -1)
            x = x + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            h = layer.post_attention_layernorm.forward(x)
            mlp = layer.mlp
            x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) *
                             F.linear(h, mlp.up_proj.weight), mlp.down_proj.weight)
        x = self.inner.norm.forward(x[:, -1])
        return F.linear(x, self.model.lm_head.weight)

    @torch.no_grad()
    def matches_transformers(self, device: torch.device) -> bool:
        """One decode step on a small left-padded batch, this way and transformers' way from
        the same prefilled cache: equal logits, or this decoder is not used."""
        from .kv_cache import buffered_cache

        vocab = self.model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (2, 6), generator=gen).to(device)
        mask = torch.ones(2, 6, dtype=torch.long, device=device)
        mask[1, :2] = 0  # a left-padded row
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        step = torch.randint(0, vocab, (2, 1), generator=gen).to(device)
        longer = torch.cat([mask, mask.new_ones(2, 1)], -1)
        new_positions = positions[:, -1:] + 1
        logits = []
        for lean in (False, True):
            cache = buffered_cache(8)
            self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True)
            if lean:
                logits.append(self(step, new_positions, longer, cache))
            else:
                logits.append(self.model(input_ids=step, attention_mask=longer,
                                         position_ids=new_positions, past_key_values=cache,
                                         use_cache=True).logits[:, -1])
        reference, lean = logits
        if torch.allclose(lean, reference, rtol=1e-5, atol=1e-5):
            return True
        log.warning("hf engine: the lean decode step differs from transformers' forward for "
                    "%s (max |diff| %.3g); decoding with transformers' forward",
                    type(self.model).__name__, float((lean - reference).abs().max()))
        return False

"""Token sampling shared by the engines that sample in Python (hf), so the log-probs they report
are defined in one place.

The reported log-prob of a sampled token is log_softmax(logits / temperature) at that token —
the same quantity the trainer recomputes (it divides its logits by the same temperature). Top-k /
top-p only restrict which tokens may be drawn; they do not renormalise the reported log-prob, so
with the defaults (top_k=0, top_p=1) sampler and trainer agree exactly. Temperature 0 is greedy
and reports log-probs at temperature 1.
"""

from __future__ import annotations

import torch


def scaled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1)


def _restrict(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every token outside the top-k and outside the top-p nucleus."""
    if top_k > 0 and top_k < logprobs.shape[-1]:
        kth = torch.topk(logprobs, top_k, dim=-1).values[..., -1:]
        logprobs = logprobs.masked_fill(logprobs < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
        cumulative = sorted_lp.exp().cumsum(dim=-1)
        drop_sorted = cumulative - sorted_lp.exp() >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logprobs = logprobs.masked_fill(drop, float("-inf"))
    return logprobs


def sample(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B, V]; returns (tokens [B], logprobs [B])."""
    logprobs = scaled_logprobs(logits, temperature)
    if temperature <= 0:
        tokens = logprobs.argmax(dim=-1)
    else:
        allowed = _restrict(logprobs, top_k, top_p)
        # Sampled on the host generator so results do not depend on the device's RNG.
        probs = allowed.exp().to("cpu", torch.float64)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

"""The policy loss: PPO-clip with token-level normalisation over the global batch.

Per loss token t of row b, with r = exp(logprobs - old_logprobs) and A the token's advantage:

    loss_t = sample_weight[b] * ( -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
                                  + kl_coef * KL_k3(current || ref) )
    loss   = sum_t loss_t / total_tokens

`total_tokens` is the loss-token count of the whole optimizer step across all ranks, so summing the
losses of any split into micro-batches and data-parallel ranks gives one token-level mean (DAPO's
token-level normalisation: a long response weighs by its length, not as one sample).

`clip_high > clip_low` is DAPO's clip-higher: low-probability tokens with a positive advantage may
grow further before the clip stops them, which keeps entropy from collapsing.

`tis_cap` switches on the decoupled objective (AReaL) with truncated importance sampling (Yao et
al., 2025): the PPO ratio is taken against the proximal policy (the weights at the start of this
optimizer step) and each token is weighted by min(pi_prox / pi_behaviour, tis_cap), where
`old_logprobs` are the behaviour (sampler) log-probs. Simplified: a train_step is one optimizer
step, so the proximal log-probs are exactly `logprobs.detach()` and the clipped ratio is 1 in
value (clipping inactive). Several optimizer steps per batch would need recomputed proximal
log-probs carried in the batch; that is where the full version goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .batch import TrainBatch


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / count.clamp(min=1.0)


def k3_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) from tokens sampled from p, given log(q / p) at those
    tokens: unbiased and never negative."""
    return torch.exp(log_ratio) - log_ratio - 1.0


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """A `LossFn` (see engines/training/base.py); a dataclass so it pickles to remote workers."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    tis_cap: float | None = None

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch, total_tokens: int,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.loss_mask.to(logprobs.dtype)
        on = mask > 0
        count = mask.sum()
        # Zero the log-ratios off the mask *before* exp: padding may hold any log-prob, and an
        # inf there would turn into NaN gradients even after masking.
        behaviour_log_ratio = torch.where(on, logprobs - batch.old_logprobs, 0.0)

        if self.tis_cap is None:
            ratio = torch.exp(behaviour_log_ratio)
            weight = torch.ones_like(ratio)
        else:
            proximal = logprobs.detach()
            ratio = torch.exp(torch.where(on, logprobs - proximal, 0.0))  # 1, with the gradient
            weight = torch.exp(behaviour_log_ratio.detach()).clamp(max=self.tis_cap)

        advantages = batch.advantages.to(logprobs.dtype)
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) * advantages
        per_token = -torch.minimum(unclipped, clipped) * weight
        metrics = {
            "clip_fraction": _masked_mean((clipped < unclipped).to(mask.dtype), mask, count),
            # KL(behaviour || current), sampled from the behaviour policy.
            "approx_kl": _masked_mean(k3_kl(behaviour_log_ratio.detach()), mask, count),
            "ratio_mean": _masked_mean(torch.exp(behaviour_log_ratio.detach()), mask, count),
        }
        if self.tis_cap is not None:
            metrics["tis_weight_mean"] = _masked_mean(weight, mask, count)

        if self.kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs batch.ref_logprobs (the reference policy's "
                                 "log-probs); compute them or set kl_coef = 0")
            kl = k3_kl(torch.where(on, batch.ref_logprobs - logprobs, 0.0))
            per_token = per_token + self.kl_coef * kl
            metrics["kl_ref"] = _masked_mean(kl.detach(), mask, count)

        per_token = per_token * batch.sample_weights.to(logprobs.dtype).unsqueeze(1)
        loss = (per_token * mask).sum() / max(int(total_tokens), 1)
        names = list(metrics)
        values = torch.stack([metrics[n].detach().float() for n in names]).tolist()  # one sync
        return loss, dict(zip(names, values))


def make_policy_loss(clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
                     tis_cap: float | None = None) -> PolicyLoss:
    """Validate the settings and return the loss function (see the module docstring)."""
    if not 0.0 <= clip_low < 1.0:
        raise ConfigError(f"clip_low = {clip_low!r}: must be in [0, 1)")
    if clip_high < 0.0:
        raise ConfigError(f"clip_high = {clip_high!r}: must be >= 0")
    if kl_coef < 0.0:
        raise ConfigError(f"kl_coef = {kl_coef!r}: must be >= 0")
    if tis_cap is not None and tis_cap <= 0.0:
        raise ConfigError(f"tis_cap = {tis_cap!r}: must be > 0, or None to disable")
    return PolicyLoss(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, tis_cap=tis_cap)

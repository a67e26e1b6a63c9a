"""The policy loss: PPO-clip with token-level normalisation over the global batch, optionally
decoupled from the behaviour policy (AReaL), importance-truncated and dual-clipped (DORA/LongCat).

Per loss token t of row b, with A the token's advantage and three log-probs of the same token:
logpi (current weights, with gradient), prox (proximal policy: the trainer's weights at the start
of this optimizer step) and behav (`old_logprobs`, the sampler that produced the token):

    coupled   (no proximal policy):  r = exp(logpi - behav)            w = 1
    decoupled (proximal policy):     r = exp(logpi - prox)             w = exp(prox - behav)
                                     w = min(w, tis_cap) when tis_cap is set; w carries no gradient
    J_t      = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
    J_t      = max(J_t, dual_clip * A)   where A < 0, when dual_clip (c > 1) is set
    loss_t   = sample_weight[b] * ( -w * J_t + kl_coef * KL_k3(current || ref) )
    loss     = sum_t loss_t / total_tokens

Decoupled PPO separates the two jobs of the old log-probs: the clip keeps the update close to the
weights being updated (prox), and w corrects for the tokens having been sampled by another, staler
policy (behav: an older version, or an inference engine whose numerics differ from the trainer's).
Truncating w bounds the variance a rare token with a large ratio would add (Yao et al., 2025).

Dual clip (Ye et al., 2020): for A < 0, min(r * A, ...) is unbounded below as r grows, so one
token the sampler liked far more than the trainer does can dominate the step; the bound c * A
stops it (and its gradient).

The proximal log-probs are `batch.prox_logprobs` when given. Without them, `tis_cap` alone still
selects the decoupled objective with prox = logpi.detach(): exact when a batch is one optimizer
step (r is 1 in value, the clip inactive), and what the trainer did before it carried prox.

`total_tokens` is the loss-token count of the whole optimizer step across all ranks, so summing the
losses of any split into micro-batches and data-parallel ranks gives one token-level mean (DAPO's
token-level normalisation: a long response weighs by its length, not as one sample).

`clip_high > clip_low` is DAPO's clip-higher: low-probability tokens with a positive advantage may
grow further before the clip stops them, which keeps entropy from collapsing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..protocol import TrainBatch


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
    dual_clip: float | None = None

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch, total_tokens: int,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.loss_mask.to(logprobs.dtype)
        on = mask > 0
        count = mask.sum()
        # Zero the log-ratios off the mask *before* exp: padding may hold any log-prob, and an
        # inf there would turn into NaN gradients even after masking.
        behaviour_log_ratio = torch.where(on, logprobs - batch.old_logprobs, 0.0)

        proximal = self._proximal(logprobs, batch)
        if proximal is None:
            ratio = torch.exp(behaviour_log_ratio)
            raw_weight = torch.ones_like(ratio)
        else:
            ratio = torch.exp(torch.where(on, logprobs - proximal, 0.0))
            raw_weight = torch.exp(torch.where(on, proximal - batch.old_logprobs, 0.0)).detach()
        weight = raw_weight if self.tis_cap is None else raw_weight.clamp(max=self.tis_cap)

        advantages = batch.advantages.to(logprobs.dtype)
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) * advantages
        objective = torch.minimum(unclipped, clipped)
        dual_clipped = torch.zeros_like(on)
        if self.dual_clip is not None:
            floor = self.dual_clip * advantages
            dual_clipped = (advantages < 0) & (objective < floor)
            objective = torch.where(dual_clipped, floor, objective)  # floor has no gradient
        per_token = -weight * objective

        # The same names whatever the mode or batch: ranks all-reduce metrics by name.
        flag = mask.dtype
        metrics = {
            "clip_fraction": _masked_mean((clipped < unclipped).to(flag), mask, count),
            "dual_clip_fraction": _masked_mean(dual_clipped.to(flag), mask, count),
            "tis_weight_mean": _masked_mean(weight, mask, count),
            "tis_truncated_fraction": _masked_mean((weight < raw_weight).to(flag), mask, count),
            # KL(behaviour || current), sampled from the behaviour policy.
            "approx_kl": _masked_mean(k3_kl(behaviour_log_ratio.detach()), mask, count),
            "ratio_mean": _masked_mean(torch.exp(behaviour_log_ratio.detach()), mask, count),
        }

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

    def _proximal(self, logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor | None:
        """The proximal log-probs, or None for the coupled objective (see the module docstring)."""
        if batch.prox_logprobs is not None:
            return batch.prox_logprobs.to(logprobs.dtype)
        if self.tis_cap is not None:
            return logprobs.detach()
        return None


def make_policy_loss(clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
                     tis_cap: float | None = None, dual_clip: float | None = None) -> PolicyLoss:
    """Validate the settings and return the loss function (see the module docstring)."""
    if not 0.0 <= clip_low < 1.0:
        raise ConfigError(f"clip_low = {clip_low!r}: must be in [0, 1)")
    if clip_high < 0.0:
        raise ConfigError(f"clip_high = {clip_high!r}: must be >= 0")
    if kl_coef < 0.0:
        raise ConfigError(f"kl_coef = {kl_coef!r}: must be >= 0")
    if tis_cap is not None and tis_cap <= 0.0:
        raise ConfigError(f"tis_cap = {tis_cap!r}: must be > 0, or None to disable")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ConfigError(f"dual_clip = {dual_clip!r}: must be > 1 (e.g. 3.0), or None to "
                          "disable")
    return PolicyLoss(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, tis_cap=tis_cap,
                      dual_clip=dual_clip)

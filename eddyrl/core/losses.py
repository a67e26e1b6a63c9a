"""The policy loss: PPO-clip with token-level normalisation over the global batch, optionally
decoupled from the behaviour policy (AReaL), importance-truncated and dual-clipped (DORA/LongCat).

Per loss token t of row b, with A the token's advantage and three log-probs of the same token:
logpi (current weights, with gradient), prox (proximal policy: the trainer's weights at the start
of this optimizer step) and behav (`old_logprobs`, the sampler that produced the token):

    coupled   (no proximal policy):  r = exp(logpi - behav)            w = 1
    decoupled (proximal policy):     r = exp(logpi - prox)             w = exp(prox - behav)
                                     w then as `algorithm.correction` says (core/corrections.py:
                                     truncated, or masked to 0); w carries no gradient
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

The proximal log-probs are `batch.prox_logprobs` when given. Without them, a correction other
than none (`tis_cap` included) still selects the decoupled objective with prox = logpi.detach():
exact when a batch is one optimizer step (r is 1 in value, the clip inactive), and what the
trainer did before it carried prox.

Besides the loss, the metrics report the train-inference mismatch on trained tokens, whatever
the correction, from log rho = prox - behav (prox = logpi.detach() when coupled):
`mismatch_kl` (k3, KL(behaviour || trainer)), `mismatch_max_abs` (max |log rho|: a maximum,
reduced with max), `is_ratio_mean` and `is_ratio_sq_mean` (of rho, from which the update
derives the normalised effective sample size `is_ess` = mean(rho)^2 / mean(rho^2) after the
ranks' reduction), and what the correction did: `correction_masked_fraction` (trained tokens
whose weight it set to 0) and `correction_truncated_fraction` (whose weight it capped).

`total_tokens` is the loss-token count of the whole optimizer step across all ranks, so summing the
losses of any split into micro-batches and data-parallel ranks gives one token-level mean (DAPO's
token-level normalisation: a long response weighs by its length, not as one sample).

`clip_high > clip_low` is DAPO's clip-higher: low-probability tokens with a positive advantage may
grow further before the clip stops them, which keeps entropy from collapsing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..protocol import TrainBatch
from .corrections import Correction, resolve_correction


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
    correction: Correction = Correction()
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
        # log rho = prox - behav in fp32, 0 off the mask: what the correction judges (its row
        # sums too) and the mismatch reported; the coupled objective's prox is logpi itself.
        anchor = logprobs.detach() if proximal is None else proximal.detach()
        log_rho = torch.where(on, anchor.float() - batch.old_logprobs.float(), 0.0)
        weight, masked, truncated = correction_weights(self.correction, raw_weight, log_rho, on,
                                                       scale=batch.correction_scale)

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
            "correction_truncated_fraction": _masked_mean(truncated.to(flag), mask, count),
            "correction_masked_fraction": _masked_mean(masked.to(flag), mask, count),
            **mismatch_metrics(log_rho, on),
            # KL(behaviour || current), sampled from the behaviour policy.
            "approx_kl": _masked_mean(k3_kl(behaviour_log_ratio.detach()), mask, count),
            "ratio_mean": _masked_mean(torch.exp(behaviour_log_ratio.detach()), mask, count),
        }

        metrics["tis_truncated_fraction"] = metrics["correction_truncated_fraction"]  # old name
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
        # float64: mean(rho^2) overflows float32 once a token's |log rho| passes 44
        values = torch.stack([metrics[n].detach().double() for n in names]).tolist()  # one sync
        return loss, dict(zip(names, values))

    def _proximal(self, logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor | None:
        """The proximal log-probs, or None for the coupled objective (see the module docstring)."""
        if batch.prox_logprobs is not None:
            return batch.prox_logprobs.to(logprobs.dtype)
        if self.correction.name != "none":
            return logprobs.detach()
        return None


def correction_weights(correction: Correction, raw_weight: torch.Tensor, log_rho: torch.Tensor,
                       on: torch.Tensor, scale: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The importance weight of each token under `correction` (core/corrections.py has the
    formulas), and which trained tokens it masked (weight 0) and truncated (weight capped).
    `raw_weight`: rho per token (1 when coupled); `log_rho`: fp32 log rho, 0 off `on`. Token
    presets judge `raw_weight` itself, so `tis_cap`'s weights are today's bit for bit;
    sequence presets sum `log_rho` over each row's trained tokens in fp32. `scale` ([B], the
    stability governor's): each bound b is applied as b ** scale on its row, the same bounds
    narrowed toward a ratio of 1 in log space (None: the bounds as configured)."""
    preset, low, high = correction.preset, correction.low, correction.high
    nothing = torch.zeros_like(on)
    if preset.level is None:
        return raw_weight, nothing, nothing
    if scale is not None:  # per row, [B, 1]: broadcasts over the row's tokens
        power = scale.to(device=log_rho.device, dtype=torch.float32).unsqueeze(1)
        low = None if low is None else torch.pow(torch.tensor(low), power)
        high = None if high is None else torch.pow(torch.tensor(high), power)
    if preset.level == "token":
        judged, kept_weight = raw_weight, raw_weight
    else:
        row_log = log_rho.sum(dim=1, keepdim=True)  # fp32; padding holds 0
        if preset.level == "geometric":
            row_log = row_log / on.sum(dim=1, keepdim=True).clamp(min=1)
        judged = torch.exp(row_log).expand_as(log_rho)  # overflows to inf, never NaN
        kept_weight = judged.to(raw_weight.dtype)
    if not preset.masks:
        truncated = on & (judged > high)
        if isinstance(high, torch.Tensor):
            return torch.minimum(kept_weight, high.to(kept_weight.dtype)), nothing, truncated
        return kept_weight.clamp(max=high), nothing, truncated
    kept = (judged >= low) & (judged <= high)
    weight = kept_weight if preset.weighted else torch.ones_like(raw_weight)
    return torch.where(kept, weight, 0.0), on & ~kept, nothing


def mismatch_metrics(log_rho: torch.Tensor, on: torch.Tensor) -> dict[str, torch.Tensor]:
    """The train-inference mismatch on trained tokens (module docstring), as 0-d tensors."""
    log_rho = log_rho.detach().double()  # rho^2 stays finite up to |log rho| = 354
    count = on.sum().clamp(min=1).double()
    rho = torch.exp(log_rho)
    return {
        "mismatch_kl": (k3_kl(log_rho) * on).sum() / count,
        "mismatch_max_abs": torch.where(on, log_rho.abs(), 0.0).amax() if on.numel() else
        log_rho.new_zeros(()),
        "is_ratio_mean": (rho * on).sum() / count,
        "is_ratio_sq_mean": (rho.square() * on).sum() / count,
    }


def effective_sample_size(ratio_mean: float, ratio_sq_mean: float) -> float:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2) from
    the token means of w and w^2 (exact after any token-weighted reduction): 1 when all weights
    are equal, towards 1/n when one dominates; 0 when w^2 overflowed (one weight dominates)."""
    if ratio_sq_mean == 0:  # no trained token: no weight to judge
        return 1.0
    if not (math.isfinite(ratio_sq_mean) and math.isfinite(ratio_mean)):
        return 0.0
    return ratio_mean ** 2 / ratio_sq_mean


def make_policy_loss(clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
                     tis_cap: float | None = None, dual_clip: float | None = None,
                     correction: str = "none", correction_low: float | None = None,
                     correction_high: float | None = None) -> PolicyLoss:
    """Validate the settings and return the loss function (see the module docstring);
    `tis_cap` X is `correction="token_tis"` with `correction_high` X."""
    if not 0.0 <= clip_low < 1.0:
        raise ConfigError(f"clip_low = {clip_low!r}: must be in [0, 1)")
    if clip_high < 0.0:
        raise ConfigError(f"clip_high = {clip_high!r}: must be >= 0")
    if kl_coef < 0.0:
        raise ConfigError(f"kl_coef = {kl_coef!r}: must be >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ConfigError(f"dual_clip = {dual_clip!r}: must be > 1 (e.g. 3.0), or None to "
                          "disable")
    resolved = resolve_correction(correction, correction_low, correction_high, tis_cap)
    return PolicyLoss(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef,
                      correction=resolved, dual_clip=dual_clip)

"""Config sections of the RL algorithm, of the training loop and of the version window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ..validation import check_choice, check_range, check_temperature, contradiction, inf_allowed
from .corrections import CorrectionName, resolve_correction


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """GRPO with the DAPO options."""

    clip_low: float = 0.2
    clip_high: float = 0.28  # > clip_low is DAPO's clip-higher
    kl_coef: float = 0.0  # KL to the initial (reference) policy; 0 = no reference model
    # Off-policy corrections (AReaL's decoupled PPO, DORA's truncated importance sampling):
    decoupled: bool = False  # clip against the proximal policy (the trainer's weights at the
    #                          start of each optimizer step), weight by prox/behaviour
    tis_cap: float | None = None  # truncate that importance weight at this value (e.g. 2.0)
    # what to do with that weight, rho = prox/behaviour (core/corrections.py, docs/config.md):
    # none | token_tis (= tis_cap) | seq_tis | token_mask | seq_mask | icepop | geo_mask;
    # a preset other than none weighs by rho even without `decoupled`
    correction: CorrectionName = "none"
    correction_low: float | None = None  # keep ratios >= this (mask presets); None: default
    correction_high: float | None = None  # truncate or mask above this; None: the default
    dual_clip: float | None = None  # bound the objective at dual_clip*A for A < 0 (e.g. 3.0)
    normalize_std: bool = True  # divide group advantages by the group's std (off: Dr. GRPO)
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal (no signal)
    max_refill_rounds: int = 0  # extra rollout rounds to refill the batch after dropping

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.clip_low", self.clip_low, 0, 1, lo_open=True, hi_open=True)
        check_range(f"{prefix}.clip_high", self.clip_high, 0, lo_open=True)
        check_range(f"{prefix}.kl_coef", self.kl_coef, 0)
        check_range(f"{prefix}.max_refill_rounds", self.max_refill_rounds, 0)
        resolve_correction(self.correction, self.correction_low, self.correction_high,
                           self.tis_cap, prefix=prefix)
        if self.dual_clip is not None:
            check_range(f"{prefix}.dual_clip", self.dual_clip, 1, lo_open=True)
        if self.clip_high < self.clip_low:
            raise contradiction(f"{prefix}.clip_high ({self.clip_high}) < {prefix}.clip_low "
                                f"({self.clip_low}); clip-higher needs clip_high >= clip_low")


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    steps: int = 100
    batch_prompts: int = 16  # prompts (groups) per training step
    eval_every: int = 20  # steps between held-out evaluations (0: only at start and end)
    eval_temperature: float = 0.0  # 0: greedy held-out accuracy
    # stop after the step that crosses this runtime time (0 or inf: no limit)
    max_seconds: float = inf_allowed(0.0, "no limit, as 0")
    # steps in a row that train no sample before the run stops, saying why (core/idle.py);
    # 0: never
    max_idle_steps: int = 10

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.steps", self.steps, 0)
        check_range(f"{prefix}.batch_prompts", self.batch_prompts, 1)
        check_range(f"{prefix}.eval_every", self.eval_every, 0)
        check_temperature(f"{prefix}.eval_temperature", self.eval_temperature)  # 0: greedy
        check_range(f"{prefix}.max_seconds", self.max_seconds, 0, allow_inf=True)
        check_range(f"{prefix}.max_idle_steps", self.max_idle_steps, 0)


Refill = Literal["batch", "stream"]
REFILLS = get_args(Refill)


@dataclass(kw_only=True, slots=True)
class WindowConfig:
    """The version window: how far rollout runs ahead of training and how it streams (the
    asynchronous settings of every mode, in one place: `eddyrl/modes.py`)."""

    # K: largest (trainer version - behaviour version) of trained data. 0 is synchronous
    # on-policy GRPO; K > 0 generates up to K batches ahead while the trainer trains.
    max_staleness: int = 0
    # Prompt groups generating at once (DORA's rollout batch size RBS, AReaL's maximum
    # concurrent rollouts); 0: (K + 1) * batch_prompts, every group the staleness bound admits.
    # batch_prompts with K >= 1 is textbook one-step off-policy: one batch generates while the
    # previous one trains.
    max_inflight_prompts: int = 0
    # Prompt groups started per weight sync (verl's fully asynchronous trainer: (1 +
    # staleness_threshold) x batch_prompts), counting those still in flight when the sync
    # came, finished-but-untrained ones included; 0: no such bound (core/version_window.py)
    max_started_per_sync: int = 0
    # When new prompt groups are dispatched: "batch": whole training batches, at step
    # boundaries; "stream": as soon as the window has room (a group collected, a step taken),
    # as DORA tops up its rollout batch (AReaL streams the same way).
    refill: Refill = "batch"
    # New weights reach running trajectories at the next decode step (per-token versions
    # recorded) instead of after they finish on the old weights.
    partial_rollout: bool = False
    # DORA's assignment (without partial rollout): after each train step, move running
    # requests of a legacy version off the workers the new version needs (abort there, resume
    # on a worker that still hosts that version), so each version holds workers in proportion
    # to its pending requests.
    migrate: bool = True
    # ...and fill free slots of workers still busy with a legacy version with new prompts of
    # that version, where the version window's deadline allows (more stale data, less idling).
    fill_legacy: bool = False
    # The stability governor (core/governor.py): after each step, K is lowered (halved) when
    # a signal passes its limit and raised by one after `governor_calm_steps` calm steps,
    # between the two bounds; starts at max_staleness. Off: K stays max_staleness.
    governor: bool = False
    governor_min_staleness: int = 0
    governor_max_staleness: int | None = None  # None: max_staleness (K never above the start)
    governor_calm_steps: int = 5  # calm steps in a row before K goes up by one
    # The correction's bounds as a second lever: the smallest scale s the governor may narrow
    # them to, each bound b applied as b ** s (log-ratio space: 0.5 takes [0.5, 2] to
    # [0.71, 1.41]). 1: the bounds stay as configured (core/governor.py says when it acts).
    governor_min_correction_scale: float = 1.0
    # The limits; None: that signal is not judged. A signal the trainer did not report in a
    # step is not judged either (no signal is not a calm one).
    governor_max_mismatch_kl: float | None = 0.01  # trainer vs rollout k3 KL, per token
    governor_max_mismatch_abs: float | None = None  # largest |log-prob difference|
    governor_max_masked_fraction: float | None = 0.05  # tokens the correction masked
    governor_min_ess: float | None = 0.5  # importance weights' normalised ESS, in [0, 1]
    governor_max_clip_fraction: float | None = None  # tokens PPO's clip cut
    governor_min_entropy: float | None = None  # the policy's token entropy

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.max_staleness", self.max_staleness, 0)
        check_range(f"{prefix}.max_inflight_prompts", self.max_inflight_prompts, 0)
        check_range(f"{prefix}.max_started_per_sync", self.max_started_per_sync, 0)
        check_choice(f"{prefix}.refill", self.refill, REFILLS)
        self._validate_governor(prefix)

    @property
    def governor_bounds(self) -> tuple[int, int]:
        """The K range the governor keeps to: (lowest, highest)."""
        high = self.max_staleness if self.governor_max_staleness is None \
            else self.governor_max_staleness
        return self.governor_min_staleness, high

    @property
    def highest_staleness(self) -> int:
        """The largest K the run may use: max_staleness, or the governor's upper bound when it
        may raise K above its start (what sizes the groups in flight, and what the colocated
        check refuses)."""
        return max(self.max_staleness, self.governor_bounds[1] if self.governor else 0)

    def _validate_governor(self, prefix: str) -> None:
        check_range(f"{prefix}.governor_min_staleness", self.governor_min_staleness, 0)
        if self.governor_max_staleness is not None:
            check_range(f"{prefix}.governor_max_staleness", self.governor_max_staleness, 0)
        check_range(f"{prefix}.governor_calm_steps", self.governor_calm_steps, 1)
        check_range(f"{prefix}.governor_min_correction_scale",
                    self.governor_min_correction_scale, 0, 1, lo_open=True)
        for name in ("mismatch_kl", "mismatch_abs", "masked_fraction", "clip_fraction"):
            key = f"governor_max_{name}"
            if (limit := getattr(self, key)) is not None:
                check_range(f"{prefix}.{key}", limit, 0)
        if self.governor_min_ess is not None:
            check_range(f"{prefix}.governor_min_ess", self.governor_min_ess, 0, 1)
        if self.governor_min_entropy is not None:
            check_range(f"{prefix}.governor_min_entropy", self.governor_min_entropy, 0)
        low, high = self.governor_bounds
        # the governor starts at max_staleness, so it must lie within the bounds
        if self.governor and not low <= self.max_staleness <= high:
            raise contradiction(
                f"{prefix}.max_staleness ({self.max_staleness}) is where the governor starts; "
                f"it must lie within [{prefix}.governor_min_staleness, "
                f"{prefix}.governor_max_staleness] = [{low}, {high}]")

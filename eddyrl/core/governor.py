"""The stability governor (`window.governor`): after each step, reads that step's signals of
train-rollout trouble and sets K, the version window's staleness bound, for the steps ahead.

The rule is additive-increase, multiplicative-decrease, within the user's bounds:

- trouble (any judged signal past its limit: mismatch KL or max abs, masked or clipped
  fraction above, ESS or entropy below): halve the lag the step actually trained at, so
  K = max(lowest, min(K, largest lag) // 2). Two exceptions hold K instead: the step's largest
  lag is above K (that data was admitted before K was last lowered: the lower K has not reached
  training yet, and lowering again would overshoot), or every sample was on-policy (lag 0:
  a smaller K cannot help).
- calm (every judged signal within its limit) for `governor_calm_steps` steps in a row: K + 1.
- no signal (the trainer reported none of the judged metrics, e.g. a step that trained
  nothing): hold, and the calm count neither grows nor resets. Absent data is never acted on.

The correction's bounds are the second lever, used only with `governor_min_correction_scale`
below 1: a scale s in [that minimum, 1] narrows them in log-ratio space (each bound b applied
as b ** s, core/losses.py). K comes first because staleness is what the governor can remove;
the bounds act where K cannot:

- trouble that lowering K cannot answer (K already at its lowest, or every sample on-policy:
  the mismatch is the engines' numerics, IcePop's case) halves s;
- trouble in the masked fraction alone while s < 1 doubles s back instead (that masking is
  the governor's own narrowing: narrowing further would feed on itself);
- calm steps widen s back to 1 (doubling) before K goes up again.

Lowering K never touches work already admitted: the window keeps each group's deadline from
its own dispatch (`VersionWindow.set_max_staleness`), so the governor only shapes new admissions.

Sans-IO: no clock, no I/O. `decide` is a function of the signals seen so far, so the runtime and
the simulator drive the same object, and a test can script it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .config import WindowConfig

Action = Literal["lower", "raise", "hold", "narrow", "widen"]


@dataclass(frozen=True, slots=True)
class Signals:
    """One step's signals, read by name from its metrics; None: the step did not report it."""

    mismatch_kl: float | None = None
    mismatch_max_abs: float | None = None
    is_ess: float | None = None
    correction_masked_fraction: float | None = None
    clip_fraction: float | None = None
    entropy: float | None = None
    # per-sample lag (trainer version - behaviour version) -> samples, as `step_metrics` logs it
    staleness_counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, metrics: dict[str, Any]) -> Signals:
        """From a step's metrics. A value that is missing, not a number or not finite (a NaN
        from an empty reduction) is no signal."""
        values = {f.name: _number(metrics.get(f.name)) for f in fields(cls)
                  if f.name != "staleness_counts"}
        counts = metrics.get("staleness_counts") or {}
        return cls(**values, staleness_counts={str(lag): int(n) for lag, n in counts.items()
                                               if int(n) > 0})

    @property
    def largest_lag(self) -> int | None:
        """The largest lag trained this step; None when no sample's lag is known."""
        return max(map(int, self.staleness_counts), default=None)


@dataclass(frozen=True, slots=True)
class Limit:
    """One judged signal: trouble when it is above (`upper`) or below the threshold."""

    signal: str
    threshold: float
    upper: bool

    def breached(self, value: float) -> bool:
        return value > self.threshold if self.upper else value < self.threshold

    def describe(self, value: float) -> str:
        return f"{self.signal} {value:.4g} {'>' if self.upper else '<'} {self.threshold:.4g}"


@dataclass(frozen=True, slots=True)
class Decision:
    k: int
    action: Action
    reason: str
    correction_scale: float = 1.0  # the correction's bounds for the steps ahead (see above)

    def metrics(self) -> dict[str, Any]:
        """The step's record of it (metrics.jsonl, the progress bar, `eddy report`)."""
        return {"governor_k": self.k, "governor_action": self.action,
                "governor_reason": self.reason,
                "governor_correction_scale": self.correction_scale}


# config key -> (signal, whether the limit is an upper one)
_LIMIT_KEYS = {"governor_max_mismatch_kl": ("mismatch_kl", True),
               "governor_max_mismatch_abs": ("mismatch_max_abs", True),
               "governor_max_masked_fraction": ("correction_masked_fraction", True),
               "governor_min_ess": ("is_ess", False),
               "governor_max_clip_fraction": ("clip_fraction", True),
               "governor_min_entropy": ("entropy", False)}


class Governor:
    def __init__(self, k: int, lowest: int, highest: int, calm_steps: int,
                 limits: list[Limit], min_scale: float = 1.0) -> None:
        if not 0 <= lowest <= k <= highest:
            raise ValueError(f"the governor's K = {k} must lie within its bounds "
                             f"[{lowest}, {highest}], lowest >= 0")
        if calm_steps < 1:
            raise ValueError(f"calm_steps = {calm_steps}: at least 1")
        if not 0 < min_scale <= 1:
            raise ValueError(f"min_scale = {min_scale}: within (0, 1]")
        self.k, self.lowest, self.highest = k, lowest, highest
        self.calm_steps = calm_steps
        self.limits = limits
        self.min_scale = min_scale
        self.scale = 1.0  # the correction's bounds: 1 as configured, smaller narrower
        self.calm = 0  # calm steps in a row since K last changed or trouble was seen

    @classmethod
    def from_config(cls, window: WindowConfig) -> Governor:
        lowest, highest = window.governor_bounds
        limits = [Limit(signal, getattr(window, key), upper)
                  for key, (signal, upper) in _LIMIT_KEYS.items()
                  if getattr(window, key) is not None]
        return cls(window.max_staleness, lowest, highest, window.governor_calm_steps, limits,
                   window.governor_min_correction_scale)

    def decide(self, signals: Signals) -> Decision:
        """K for the steps ahead, from this step's signals."""
        judged = [(limit, value) for limit in self.limits
                  if (value := getattr(signals, limit.signal)) is not None]
        if not judged:
            return self._decision("hold", "no signal: none of the judged metrics reported")
        breached = [limit for limit, value in judged if limit.breached(value)]
        if breached:
            self.calm = 0
            trouble = ", ".join(limit.describe(getattr(signals, limit.signal))
                                for limit in breached)
            if self.scale < 1 and {b.signal for b in breached} == {"correction_masked_fraction"}:
                return self._widen(f"{trouble}: the narrowed bounds mask too much")
            return self._lower(trouble, signals.largest_lag)
        self.calm += 1
        if self.scale < 1:  # the bounds widen back before K goes up
            if self.calm < self.calm_steps:
                return self._decision("hold", f"calm {self.calm}/{self.calm_steps}")
            self.calm = 0
            return self._widen(f"calm for {self.calm_steps} step(s)")
        if self.k >= self.highest:
            return self._decision("hold", f"calm; K at governor_max_staleness {self.highest}")
        if self.calm < self.calm_steps:
            return self._decision("hold", f"calm {self.calm}/{self.calm_steps}")
        self.k, self.calm = self.k + 1, 0
        return self._decision("raise", f"calm for {self.calm_steps} step(s)")

    def _decision(self, action: Action, reason: str) -> Decision:
        return Decision(self.k, action, reason, self.scale)

    def _widen(self, reason: str) -> Decision:
        self.scale = min(1.0, self.scale * 2)
        return self._decision("widen", f"{reason}; correction bounds at scale {self.scale:.3g}")

    def _narrow(self, trouble: str, why: str) -> Decision:
        """K cannot answer `trouble`: narrow the correction's bounds instead, if allowed."""
        if self.scale <= self.min_scale:
            limit = ("" if self.min_scale == 1 else
                     f"; correction bounds at governor_min_correction_scale {self.min_scale:.3g}")
            return self._decision("hold", f"{trouble}; {why}{limit}")
        self.scale = max(self.min_scale, self.scale / 2)
        return self._decision("narrow", f"{trouble}; {why}: correction bounds at scale "
                                        f"{self.scale:.3g}")

    def _lower(self, trouble: str, lag: int | None) -> Decision:
        if lag is not None and lag > self.k:
            return self._decision("hold", f"{trouble}; at lag {lag}, admitted before K was "
                                          f"lowered to {self.k}: waiting for it to train")
        if lag == 0:
            return self._narrow(trouble, "all samples on-policy (lag 0): a smaller K cannot "
                                         "help")
        # halve the lag trained (at most K here); with no lag known, K itself
        target = max(self.lowest, (self.k if lag is None else lag) // 2)
        if target >= self.k:
            return self._narrow(trouble, f"K at governor_min_staleness {self.lowest}")
        self.k = target
        return self._decision("lower", trouble + ("" if lag is None else f" at lag {lag}"))

    # -- checkpoints ---------------------------------------------------------------------------

    def state(self) -> dict[str, float]:
        return {"k": self.k, "calm": self.calm, "scale": self.scale}

    def restore(self, state: dict[str, float]) -> None:
        """Go on from a checkpoint's K, calm count and bounds' scale, kept within this run's
        bounds (a resume may set others; a checkpoint from before the scale has none: 1)."""
        self.k = min(max(int(state["k"]), self.lowest), self.highest)
        self.calm = int(state["calm"])
        self.scale = min(max(float(state.get("scale", 1.0)), self.min_scale), 1.0)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None

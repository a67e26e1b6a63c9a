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

Action = Literal["lower", "raise", "hold"]


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

    def metrics(self) -> dict[str, Any]:
        """The step's record of it (metrics.jsonl, the progress bar, `eddy report`)."""
        return {"governor_k": self.k, "governor_action": self.action,
                "governor_reason": self.reason}


# config key -> (signal, whether the limit is an upper one)
_LIMIT_KEYS = {"governor_max_mismatch_kl": ("mismatch_kl", True),
               "governor_max_mismatch_abs": ("mismatch_max_abs", True),
               "governor_max_masked_fraction": ("correction_masked_fraction", True),
               "governor_min_ess": ("is_ess", False),
               "governor_max_clip_fraction": ("clip_fraction", True),
               "governor_min_entropy": ("entropy", False)}


class Governor:
    def __init__(self, k: int, lowest: int, highest: int, calm_steps: int,
                 limits: list[Limit]) -> None:
        if not 0 <= lowest <= k <= highest:
            raise ValueError(f"the governor's K = {k} must lie within its bounds "
                             f"[{lowest}, {highest}], lowest >= 0")
        if calm_steps < 1:
            raise ValueError(f"calm_steps = {calm_steps}: at least 1")
        self.k, self.lowest, self.highest = k, lowest, highest
        self.calm_steps = calm_steps
        self.limits = limits
        self.calm = 0  # calm steps in a row since K last changed or trouble was seen

    @classmethod
    def from_config(cls, window: WindowConfig) -> Governor:
        lowest, highest = window.governor_bounds
        limits = [Limit(signal, getattr(window, key), upper)
                  for key, (signal, upper) in _LIMIT_KEYS.items()
                  if getattr(window, key) is not None]
        return cls(window.max_staleness, lowest, highest, window.governor_calm_steps, limits)

    def decide(self, signals: Signals) -> Decision:
        """K for the steps ahead, from this step's signals."""
        judged = [(limit, value) for limit in self.limits
                  if (value := getattr(signals, limit.signal)) is not None]
        if not judged:
            return Decision(self.k, "hold", "no signal: none of the judged metrics reported")
        breaches = [limit.describe(value) for limit, value in judged if limit.breached(value)]
        if breaches:
            self.calm = 0
            return self._lower(", ".join(breaches), signals.largest_lag)
        self.calm += 1
        if self.k >= self.highest:
            return Decision(self.k, "hold", f"calm; K at governor_max_staleness {self.highest}")
        if self.calm < self.calm_steps:
            return Decision(self.k, "hold", f"calm {self.calm}/{self.calm_steps}")
        self.k, self.calm = self.k + 1, 0
        return Decision(self.k, "raise", f"calm for {self.calm_steps} step(s)")

    def _lower(self, trouble: str, lag: int | None) -> Decision:
        if lag is not None and lag > self.k:
            return Decision(self.k, "hold", f"{trouble}; at lag {lag}, admitted before K was "
                                            f"lowered to {self.k}: waiting for it to train")
        if lag == 0:
            return Decision(self.k, "hold", f"{trouble}; all samples on-policy (lag 0): a "
                                            "smaller K cannot help")
        # halve the lag trained (at most K here); with no lag known, K itself
        target = max(self.lowest, (self.k if lag is None else lag) // 2)
        if target >= self.k:
            return Decision(self.k, "hold", f"{trouble}; K at governor_min_staleness "
                                            f"{self.lowest}")
        self.k = target
        return Decision(self.k, "lower", trouble + ("" if lag is None else f" at lag {lag}"))

    # -- checkpoints ---------------------------------------------------------------------------

    def state(self) -> dict[str, int]:
        return {"k": self.k, "calm": self.calm}

    def restore(self, state: dict[str, int]) -> None:
        """Go on from a checkpoint's K and calm count, kept within this run's bounds (a resume
        may set others)."""
        self.k = min(max(int(state["k"]), self.lowest), self.highest)
        self.calm = int(state["calm"])


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None

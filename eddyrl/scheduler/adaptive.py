"""ReFlow's adaptive scheduler with Libra's planner rule: after each step it decides whether to
change the rollout/training split or the generation strategy, at most one change per decision.

- **Split (Libra's hysteresis).** With the smoothed train/rollout time ratio r and rollout
  pressure p (waiting requests / capacity): give a borrowed worker back when p >= 0.80 or
  r <= 0.90; borrow one when r >= 1.15 and p < 0.80 (a worker borrowed from a saturated rollout
  would be returned at once). The gap between 0.90 and 1.15 is the hysteresis band.
- **Generation strategy (ReFlow).** Candidate plans (concurrency x partial rollout on/off, the
  latter only with `switch_partial_rollout`, since it changes the algorithm; with
  Libra's buckets also the bucket layout, i.e. workers per bucket: the current layout and every
  layout one worker away from it) are scored by the predicted step time max(t_rollout, t_train)
  from a pluggable predictor (the cost model). The best candidate replaces the current plan only if its relative gain over the
  current plan's prediction is >= min_gain AND the saving over `horizon_steps` steps exceeds
  the measured reconfiguration cost (Libra: saving - cost > 0 and gain >= 5%). The papers do
  not say what "saving" is measured in: here the predictor gives the relative gain (its biases
  cancel between two of its own predictions) and the measured step time turns it into seconds.
- **No flapping.** Signals are smoothed (EMA or median over `window` steps). After a change
  nothing changes for `cooldown_steps` steps, and the smoothing restarts, since measurements
  taken before the change describe a different system; a decision needs `window` measurements
  taken since.

Every decision, "keep" included, is recorded with its inputs and reason for the timeline.
Sans-IO: no clock; the runtime reports measurements and applies decisions (e.g. via the
elastic pool), the simulator can drive the same object.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Literal, get_args

from ..validation import check_choice, check_range, contradiction

Smoothing = Literal["ema", "median"]
SMOOTHING = get_args(Smoothing)


@dataclass(kw_only=True, slots=True)
class AdaptiveConfig:
    enabled: bool = False
    borrow_ratio: float = 1.15  # borrow a rollout worker when train/rollout time >= this
    return_ratio: float = 0.90  # give it back when train/rollout time <= this ...
    return_pressure: float = 0.80  # ... or when rollout pressure >= this
    min_gain: float = 0.05  # smallest relative step-time gain worth a new generation plan
    horizon_steps: int = 20  # steps a new plan is expected to run: its saving is counted over them
    reconfiguration_cost_s: float = 15.0  # assumed (Libra's ~15 s) until one is measured
    cooldown_steps: int = 10  # no change for this many steps after one
    smoothing: Smoothing = "ema"  # "ema" (alpha = 2 / (window + 1)) or "median" of the last window
    window: int = 8  # steps of smoothing; also measurements needed after a change
    concurrency_choices: list[int] = field(default_factory=lambda: [32, 64, 128, 256])
    # Whether a plan may turn partial rollout on or off. It changes the algorithm (trajectories
    # then span policy versions, breaking DORA's one-version-per-trajectory), so a plan keeps
    # the run's `window.partial_rollout` unless this is set.
    switch_partial_rollout: bool = False
    # The cost model's hardware for plan predictions: a table name (H100, 910B2, ...), or auto
    # (measure this machine when rollout runs on the CPU; no plan predictions otherwise).
    accelerator: str = "auto"

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.borrow_ratio", self.borrow_ratio, 1, lo_open=True)
        check_range(f"{prefix}.return_ratio", self.return_ratio, 0, lo_open=True)
        check_range(f"{prefix}.return_pressure", self.return_pressure, 0, 1, lo_open=True)
        check_range(f"{prefix}.min_gain", self.min_gain, 0, 1, hi_open=True)
        check_range(f"{prefix}.horizon_steps", self.horizon_steps, 1)
        check_range(f"{prefix}.reconfiguration_cost_s", self.reconfiguration_cost_s, 0)
        check_range(f"{prefix}.cooldown_steps", self.cooldown_steps, 0)
        check_choice(f"{prefix}.smoothing", self.smoothing, SMOOTHING)
        check_range(f"{prefix}.window", self.window, 1)
        if not self.concurrency_choices:
            raise contradiction(f"{prefix}.concurrency_choices is empty: list at least one")
        for index, concurrency in enumerate(self.concurrency_choices):
            check_range(f"{prefix}.concurrency_choices[{index}]", concurrency, 1)
        if self.accelerator != "auto":
            from .hardware import lookup_accelerator

            lookup_accelerator(self.accelerator)  # an unknown name is reported with the known
        if self.return_ratio >= self.borrow_ratio:
            raise contradiction(
                f"{prefix}.return_ratio ({self.return_ratio}) >= {prefix}.borrow_ratio "
                f"({self.borrow_ratio}): a borrowed worker would be returned at once; the gap "
                "return_ratio < borrow_ratio is the hysteresis band")


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    concurrency: int  # requests in flight per rollout worker
    partial_rollout: bool  # cut unfinished generations at the step boundary, resume them later
    layout: tuple[int, ...] = ()  # rollout workers per bucket, in bucket order (): no buckets


def neighbour_layouts(layout: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Layouts one worker away: one worker moved between two buckets, each keeping >= 1."""
    moved = []
    for source, target in itertools.permutations(range(len(layout)), 2):
        if layout[source] > 1:
            new = list(layout)
            new[source] -= 1
            new[target] += 1
            moved.append(tuple(new))
    return moved


Predictor = Callable[[GenerationPlan], tuple[float, float]]  # plan -> (t_rollout, t_train) s


class Change(str, Enum):
    KEEP = "keep"
    BORROW = "borrow"  # move one rollout worker to training
    RETURN = "return"  # move one borrowed worker back to rollout
    SET_PLAN = "set_plan"  # switch to `Decision.plan`


@dataclass(frozen=True, slots=True)
class Signals:
    """Smoothed measurements."""

    rollout_s: float
    train_s: float
    pressure: float  # waiting rollout requests / capacity
    staleness: float

    @property
    def ratio(self) -> float:
        return self.train_s / self.rollout_s

    @property
    def step_s(self) -> float:
        return max(self.rollout_s, self.train_s)  # rollout and training overlap


@dataclass(frozen=True, slots=True)
class Decision:
    step: int
    change: Change
    reason: str
    signals: Signals | None  # None before the first measurement
    can_borrow: bool
    can_return: bool
    plan: GenerationPlan  # in force after this decision


class Smoother:
    """One smoothed signal: an EMA (alpha = 2 / (window + 1)) or the median of the last
    `window` values."""

    def __init__(self, method: str, window: int) -> None:
        check_choice("smoothing", method, SMOOTHING)
        self.method = method
        self.alpha = 2 / (window + 1)
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.ema = 0.0

    def add(self, value: float) -> None:
        self.ema = value if self.count == 0 else self.ema + self.alpha * (value - self.ema)
        self.recent.append(value)
        self.count += 1

    @property
    def value(self) -> float:
        return self.ema if self.method == "ema" else statistics.median(self.recent)


class AdaptiveScheduler:
    def __init__(self, config: AdaptiveConfig, plan: GenerationPlan,
                 predict: Predictor | None = None) -> None:
        self.config = config
        self.plan = plan
        self.predict = predict  # None: only the split is adapted
        self.step = 0  # last observed step
        self.decisions: list[Decision] = []
        self._last_change_step: int | None = None
        self._costs: list[float] = []  # measured reconfiguration costs
        self._smoothers = self._fresh_smoothers()  # rollout_s, train_s, pressure, staleness

    # -- inputs ----------------------------------------------------------------------------

    def observe(self, step: int, rollout_s: float, train_s: float, pressure: float,
                staleness: float) -> None:
        """Measurements of trainer step `step` (strictly increasing)."""
        if step <= self.step:
            raise ValueError(f"observe(step={step}) after step {self.step}: steps must increase")
        for name, value in (("rollout_s", rollout_s), ("train_s", train_s)):
            if not value > 0 or math.isinf(value):
                raise ValueError(f"{name} = {value!r} at step {step}: must be a positive time")
        for name, value in (("pressure", pressure), ("staleness", staleness)):
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"{name} = {value!r} at step {step}: must be finite and >= 0")
        self.step = step
        for smoother, value in zip(self._smoothers, (rollout_s, train_s, pressure, staleness)):
            smoother.add(value)

    def record_reconfiguration_cost(self, seconds: float) -> None:
        """How long applying the last plan took; plans are then judged by the mean measured."""
        check_range("reconfiguration cost (s)", seconds, 0)
        self._costs.append(seconds)

    # -- queries ---------------------------------------------------------------------------

    def signals(self) -> Signals | None:
        if self._smoothers[0].count == 0:
            return None
        return Signals(*(smoother.value for smoother in self._smoothers))

    @property
    def reconfiguration_cost_s(self) -> float:
        return statistics.fmean(self._costs) if self._costs else self.config.reconfiguration_cost_s

    # -- the decision ----------------------------------------------------------------------

    def decide(self, *, can_borrow: bool, can_return: bool) -> Decision:
        """At most one change. `can_borrow`/`can_return`: whether the pool has a worker it may
        move now (e.g. `bool(pool.joinable())`, `bool(pool.leavable())`)."""
        change, reason, plan = self._choose(can_borrow, can_return)
        decision = Decision(self.step, change, reason, self.signals(), can_borrow, can_return,
                            plan)
        self.decisions.append(decision)
        if change is not Change.KEEP:
            self.plan = plan
            self._last_change_step = self.step
            self._smoothers = self._fresh_smoothers()
        return decision

    def _choose(self, can_borrow: bool, can_return: bool) -> tuple[Change, str, GenerationPlan]:
        cfg = self.config
        keep = self.plan
        if not cfg.enabled:
            return Change.KEEP, "adaptive scheduling is disabled", keep
        if self._last_change_step is not None:
            left = self._last_change_step + cfg.cooldown_steps - self.step
            if left > 0:
                return Change.KEEP, (f"cooldown: {left} step(s) left after the change at step "
                                     f"{self._last_change_step}"), keep
        signals, measured = self.signals(), self._smoothers[0].count
        if signals is None or measured < cfg.window:
            return Change.KEEP, (f"warming up: {measured}/{cfg.window} measurements since the "
                                 "last change"), keep
        ratio, pressure = signals.ratio, signals.pressure
        if can_return and pressure >= cfg.return_pressure:
            return Change.RETURN, (f"rollout pressure {pressure:.2f} >= return_pressure "
                                   f"{cfg.return_pressure}"), keep
        if can_return and ratio <= cfg.return_ratio:
            return Change.RETURN, (f"train/rollout ratio {ratio:.3f} <= return_ratio "
                                   f"{cfg.return_ratio}"), keep
        if ratio >= cfg.borrow_ratio:
            if not can_borrow:
                split = f"ratio {ratio:.3f} >= borrow_ratio but no worker can be borrowed"
            elif pressure >= cfg.return_pressure:
                split = (f"ratio {ratio:.3f} >= borrow_ratio but rollout pressure "
                         f"{pressure:.2f} >= return_pressure: it would be returned at once")
            else:
                return Change.BORROW, (f"train/rollout ratio {ratio:.3f} >= borrow_ratio "
                                       f"{cfg.borrow_ratio}"), keep
        elif ratio <= cfg.return_ratio:  # and nothing to return
            split = f"ratio {ratio:.3f} <= return_ratio but no borrowed worker to return"
        else:
            split = f"ratio {ratio:.3f} within ({cfg.return_ratio}, {cfg.borrow_ratio})"
        new_plan, why = self._evaluate_plans(signals)
        if new_plan is not None:
            return Change.SET_PLAN, why, new_plan
        return Change.KEEP, f"{split}; {why}", keep

    def _evaluate_plans(self, signals: Signals) -> tuple[GenerationPlan | None, str]:
        """The best candidate plan if it is worth its reconfiguration cost, and why (not)."""
        predict = self.predict
        if predict is None:
            return None, "no plan predictor"
        current_s = _predicted_step_s(predict, self.plan)
        others = [p for p in self.candidates() if p != self.plan]
        if not others:
            return None, "no other plan to choose (one concurrency choice, no buckets)"
        scored = [(_predicted_step_s(predict, p), i, p) for i, p in enumerate(others)]
        best_s, _, best = min(scored)
        gain = 1 - best_s / current_s
        saving = gain * signals.step_s * self.config.horizon_steps
        cost = self.reconfiguration_cost_s
        described = (f"best plan {best} predicts {best_s:.2f}s/step vs {current_s:.2f}s "
                     f"(gain {gain:.1%}, saving {saving:.1f}s over {self.config.horizon_steps} "
                     f"steps, reconfiguration cost {cost:.1f}s)")
        if gain < self.config.min_gain:
            return None, f"{described}: gain < min_gain {self.config.min_gain:.0%}"
        if saving - cost <= 0:
            return None, f"{described}: saving does not exceed the cost"
        return best, described

    def candidates(self) -> list[GenerationPlan]:
        """Concurrency (x partial rollout on/off, if plans may switch it) under the current
        bucket layout, and the current concurrency and partial rollout under each layout one
        worker away (one step at a time: a layout change moves one worker per decision)."""
        plan = self.plan
        partial = (False, True) if self.config.switch_partial_rollout else \
            (plan.partial_rollout,)
        plans = [GenerationPlan(c, p, plan.layout) for c, p in
                 itertools.product(sorted(set(self.config.concurrency_choices)), partial)]
        plans += [GenerationPlan(plan.concurrency, plan.partial_rollout, layout)
                  for layout in neighbour_layouts(plan.layout)]
        return plans

    def _fresh_smoothers(self) -> list[Smoother]:
        return [Smoother(self.config.smoothing, self.config.window) for _ in range(4)]


def _predicted_step_s(predict: Predictor, plan: GenerationPlan) -> float:
    t_rollout, t_train = predict(plan)
    step_s = max(t_rollout, t_train)
    if not step_s > 0 or math.isinf(step_s):
        raise ValueError(f"predictor returned (t_rollout={t_rollout!r}, t_train={t_train!r}) "
                         f"for {plan}: times must be positive and finite")
    return step_s

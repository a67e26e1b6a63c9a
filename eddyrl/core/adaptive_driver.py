"""The adaptive scheduler at work (`scheduler/adaptive.py`), on its own: at each step boundary
it reports the step's measurements, asks for a decision and applies the generation plans
itself (concurrency, partial rollout, bucket layout), with or without the elastic pool.

A split decision (borrow or return a rollout worker) is only a decision here: the elastic
driver, when there is one, asks `decide` with what its pool allows and performs the move;
without the pool nothing can be lent (`can_borrow = can_return = False`), so the scheduler
decides only plans. `NoAdaptive` stands in when the scheduler is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..runtime_protocol import PlannableRuntime
from ..scheduler.adaptive import AdaptiveScheduler, Change, Decision, GenerationPlan
from ..scheduler.plan_predictor import BucketLoad, PlanPredictor, StepObservation
from .rollout import StreamingRollout


@dataclass
class AdaptiveDriver:
    runtime: PlannableRuntime  # eddyrl.build checks it is Plannable
    rollout: StreamingRollout
    scheduler: AdaptiveScheduler
    rollout_group_size: int = 1  # requests per group (n_samples), for the pressure signal
    predictor: PlanPredictor | None = None  # the scheduler's view of plans, if any
    events: list[dict[str, Any]] = field(default_factory=list)
    _busy_before: float | None = None

    @property
    def plan(self) -> GenerationPlan:
        return self.scheduler.plan

    async def decide(self, step: int, metrics: dict[str, Any], *, can_borrow: bool = False,
                     can_return: bool = False) -> Decision | None:
        """Report step `step` and decide; a new plan is applied before this returns, a split
        decision is returned for the elastic driver to carry out. None: nothing measured yet
        (the first step, or a step that trained nothing)."""
        if not metrics.get("train_s"):
            return None
        rollout_s = await self._rollout_busy_per_worker()
        if rollout_s <= 0:
            return None
        serving = max(sum(self.rollout.serving()), 1)
        pressure = min(1.0, self.rollout.window.running * self.rollout_group_size /
                       (serving * self.rollout.slots_per_worker))
        self.scheduler.observe(step, rollout_s, metrics["train_s"], pressure,
                               float(metrics.get("staleness_mean", 0.0)))
        if self.predictor is not None and metrics.get("response_len_max"):
            mean_length = float(metrics["response_len_mean"])
            self.predictor.observe(StepObservation(
                requests_per_worker=metrics.get("groups_generated", 0) *
                self.rollout_group_size / serving,
                mean_length=mean_length, max_length=float(metrics["response_len_max"]),
                mean_context=float(metrics.get("prompt_len_mean", 0.0)) + mean_length / 2,
                rollout_s=rollout_s, train_s=metrics["train_s"], buckets=self._bucket_loads()),
                self.scheduler.plan)
        decision = self.scheduler.decide(can_borrow=can_borrow, can_return=can_return)
        self.events.append({"step": step, "decision": decision.change.value,
                            "reason": decision.reason})
        if decision.change is Change.SET_PLAN:
            await self._apply_plan(step, decision.plan)
        return decision

    def _bucket_loads(self) -> tuple[BucketLoad, ...]:
        """Per bucket, the training requests that finished there since the last boundary."""
        router = self.rollout.router
        if router is None:
            return ()
        lengths = self.rollout.take_bucket_lengths()
        loads = []
        for spec in router.config.buckets:
            seen = lengths.get(spec.name, [])
            loads.append(BucketLoad(len(seen), sum(seen) / len(seen) if seen else 0.0,
                                    float(max(seen, default=0))))
        return tuple(loads)

    async def _apply_plan(self, step: int, plan: GenerationPlan) -> None:
        """ReFlow's generation strategy on every rollout worker (and Libra's bucket layout on
        the router), timed: the measured cost is what the scheduler weighs the next plan
        change against."""
        started = self.runtime.now()
        hosted = await self.runtime.configure_rollout(plan.concurrency, plan.partial_rollout)
        self.rollout.use_partial_rollout(plan.partial_rollout)
        self.rollout.published(self.rollout.latest, hosted)
        if plan.layout and self.rollout.router is not None:
            self.rollout.router.set_layout(plan.layout)
        self.scheduler.record_reconfiguration_cost(self.runtime.now() - started)
        self.events.append({"step": step, "plan": {
            "concurrency": plan.concurrency, "partial_rollout": plan.partial_rollout,
            **({"layout": list(plan.layout)} if plan.layout else {})}})

    async def _rollout_busy_per_worker(self) -> float:
        """Seconds the serving rollout workers spent generating since the last boundary, per
        worker: the rollout time of a step, whether or not the trainer waited for it."""
        stats = await self.runtime.worker_stats()
        busy = sum(s.busy_seconds for s in stats)
        before, self._busy_before = self._busy_before, busy
        if before is None:
            return 0.0
        return (busy - before) / max(sum(self.rollout.serving()), 1)

    def report(self) -> dict[str, Any]:
        return {"events": list(self.events)}


class NoAdaptive:
    """The adaptive scheduler switched off: no plans, no split decisions."""

    plan = None

    async def decide(self, step: int, metrics: dict[str, Any], *, can_borrow: bool = False,
                     can_return: bool = False) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {}

"""Predicted rollout and training time of a generation plan, for the adaptive scheduler: the
roofline cost model gives the shape, the run's measurements give the scale.

A plan is a concurrency (requests one worker decodes together) and partial rollout on/off. In
the model's units, one worker's rollout time for a step is

    waves(plan) * length(plan) * decode_step_seconds(batch(plan), mean_context)

with waves = ceil(requests per worker / concurrency) and batch = min(concurrency, requests per
worker): a decode batch costs one step time per generated position. In a synchronous run
(`tail_bounds_step`) a batch without partial rollout runs until its longest response ends
(length = the step's max response length); with it, a weight update interrupts the tail, which
resumes on the new weights, so a step pays for about the mean length. With staleness K >= 1
the rollout goes on with the next prompts while a tail finishes, so a step pays for about the
mean length either way (partial rollout then buys nothing the model can see). The prediction is scaled so that the current plan's equals the measured
rollout time (busy seconds per worker), which absorbs what the roofline does not model
(Python overhead, sampling, a 2-core CPU shared with training); only ratios between plans come
from the model. Training time is measured and does not depend on the plan.

With Libra's buckets the step's requests are observed per bucket (where each finished: count,
mean and max length), and a layout (workers per bucket) is predicted bucket by bucket: each
bucket's workers share its requests, and the rollout ends with the slowest bucket.

Sans-IO: no clock; `observe` takes the numbers, `__call__` is the adaptive scheduler's
`Predictor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Any, Mapping

from .adaptive import GenerationPlan
from .cost_model import CostModel
from .hardware import lookup_accelerator, measure_cpu, model_from_hf_config


@dataclass(frozen=True, slots=True)
class BucketLoad:
    """The requests that finished in one bucket during a step."""

    requests: int
    mean_length: float
    max_length: float


@dataclass(frozen=True, slots=True)
class StepObservation:
    requests_per_worker: float  # responses one serving rollout worker generated this step
    mean_length: float  # mean response tokens
    max_length: float  # longest response tokens
    mean_context: float  # mean tokens in the KV cache while decoding
    rollout_s: float  # measured rollout busy seconds per worker
    train_s: float  # measured training seconds
    buckets: tuple[BucketLoad, ...] = ()  # per bucket, in bucket order (with a router)


class PlanPredictor:
    def __init__(self, cost: CostModel, plan: GenerationPlan, *,
                 tail_bounds_step: bool = True) -> None:
        self.cost = cost
        self.plan = plan  # the plan the observations were measured under
        self.tail_bounds_step = tail_bounds_step  # synchronous: the longest response ends it
        self.last: StepObservation | None = None

    def observe(self, observation: StepObservation, plan: GenerationPlan) -> None:
        self.last, self.plan = observation, plan

    def model_rollout_s(self, plan: GenerationPlan) -> float:
        """The cost model's (unscaled) rollout time of the last step under `plan`."""
        obs = self._observation()
        if obs.buckets and plan.layout:
            if len(plan.layout) != len(obs.buckets):
                raise ValueError(f"layout {plan.layout} has {len(plan.layout)} buckets, the "
                                 f"observation {len(obs.buckets)}")
            per_bucket = [self._worker_s(plan, load.requests / workers, load.mean_length,
                                         load.max_length, obs.mean_context)
                          for load, workers in zip(obs.buckets, plan.layout) if load.requests]
            if per_bucket:
                return max(per_bucket)
        return self._worker_s(plan, obs.requests_per_worker, obs.mean_length, obs.max_length,
                              obs.mean_context)

    def _worker_s(self, plan: GenerationPlan, requests_per_worker: float, mean_length: float,
                  max_length: float, mean_context: float) -> float:
        requests = max(requests_per_worker, 1.0)
        batch = max(1, min(plan.concurrency, math.ceil(requests)))
        waves = math.ceil(requests / plan.concurrency)
        tail = self.tail_bounds_step and not plan.partial_rollout
        length = max_length if tail else mean_length
        return waves * max(length, 1.0) * self.cost.decode_step_seconds(batch, mean_context)

    def __call__(self, plan: GenerationPlan) -> tuple[float, float]:
        obs = self._observation()
        scale = obs.rollout_s / self.model_rollout_s(self.plan)
        return scale * self.model_rollout_s(plan), obs.train_s

    def _observation(self) -> StepObservation:
        if self.last is None:
            raise ValueError("PlanPredictor: no step observed yet")
        return self.last


def rollout_cost_model(accelerator: str, device_type: str, model_config: Mapping[str, Any],
                       ) -> CostModel | None:
    """The cost model of the rollout devices: `accelerator` names a table entry (H100, 910B2,
    ...); "auto" measures this machine when rollout runs on the CPU and gives None (no plan
    prediction) on an accelerator it cannot name."""
    model = model_from_hf_config("policy", model_config)
    if accelerator != "auto":
        return CostModel(lookup_accelerator(accelerator), model, dtype_bytes=2)
    if device_type == "cpu":
        return CostModel(measure_cpu(), model, dtype_bytes=4)  # CPU engines run fp32
    return None

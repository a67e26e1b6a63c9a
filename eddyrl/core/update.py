"""The RL update of one training step on one trainer rank: the KL reference's log-probs, the
pre-update log-probs and how far they are from the sampler's, the proximal log-probs of the
decoupled loss, and `mini_batches` optimizer steps of the policy loss (core/losses.py).

`PolicyUpdate` is the algorithm; the engines do the arithmetic. It calls only the training
engine's narrow interface (`TrainingEngine`: log-probs, one optimizer step), so it runs the same
in a Ray actor (runtime/trainer_rank.py `TrainerRank`), in one process (runtime/local.py, through
the same `TrainerRank`) and against a scripted engine in tests. Building the engines, the
device, profiling and the elastic pool's transport (Ray references) stay in the runtime: the
joined replicas' gradients arrive as a plain callable (`ReplicaShare`).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..metric_kinds import combine_parts
from ..protocol import TrainBatch
from .config import AlgorithmConfig
from .losses import PolicyLoss, effective_sample_size, make_policy_loss
from .update_passes import OLD, PROXIMAL, REFERENCE, forward_passes

Gradients = dict[str, torch.Tensor]
# The joined replicas' part of a step (elastic pool): their summed gradients (HF names) and
# what to report of them. Called inside the engine's optimizer step, after this rank's own
# backward passes, so fetching them overlaps with the rank's own work.
ReplicaShare = Callable[[], tuple[Gradients, dict[str, float]]]


class TrainingEngine(Protocol):
    """What the update needs of a training engine (engines/training/base.py has the whole
    contract); a KL reference needs `compute_logprobs` only."""

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] log-probs of `batch.input_ids` under the current weights (no grad)."""

    def train_step(self, batch: TrainBatch, loss_fn: PolicyLoss, *, extra_tokens: int = 0,
                   external_grads: Callable[[], Gradients] | None = None,
                   logprobs_out: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step; `logprobs_out` receives the log-probs of its forward passes."""


class GradientSource(Protocol):
    """A joined replica of the elastic pool (engines/training/replica.py): gradients of its
    share of a step, no optimizer."""

    def logprobs(self, batch: TrainBatch) -> torch.Tensor: ...

    def gradients(self, batch: TrainBatch, loss_fn: PolicyLoss, total_tokens: int,
                  ) -> tuple[Gradients, dict[str, float]]: ...


def logit_temperature(sampling_temperature: float) -> float:
    """The temperature the trainer divides logits by: the sampler's, so the trainer's
    log-probs are of the distribution the tokens were drawn from (greedy reports at 1)."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


class PolicyUpdate:
    """The update of `algorithm` (its loss settings and `decoupled`) in `mini_batches`
    optimizer steps per RL step."""

    def __init__(self, algorithm: AlgorithmConfig, *, mini_batches: int = 1) -> None:
        self.loss = make_policy_loss(clip_low=algorithm.clip_low, clip_high=algorithm.clip_high,
                                     kl_coef=algorithm.kl_coef, tis_cap=algorithm.tis_cap,
                                     dual_clip=algorithm.dual_clip,
                                     correction=algorithm.correction,
                                     correction_low=algorithm.correction_low,
                                     correction_high=algorithm.correction_high)
        self.decoupled = algorithm.decoupled
        self.mini_batches = mini_batches
        # which log-prob passes run besides the optimizer steps: decided in update_passes.py,
        # which the simulator's cost of a step reads too
        self.passes = forward_passes(algorithm, mini_batches)
        self._proximal_passes = {p.mini_batch for p in self.passes if p.role == PROXIMAL}

    @property
    def needs_reference(self) -> bool:
        """Whether `__call__` needs a KL reference engine (the initial policy)."""
        return any(p.role == REFERENCE for p in self.passes)

    def __call__(self, batch: TrainBatch, engine: TrainingEngine,
                 reference: TrainingEngine | None = None, *,
                 replicas: ReplicaShare | None = None, replica_tokens: int = 0,
                 ) -> dict[str, float]:
        """Update `engine` on this rank's rows of `batch`; returns the step's metrics (means
        over the optimizer steps; `skipped_updates` is a count) and how far the trainer's
        log-probs are from the sampler's on the same tokens, before the update.
        `replicas` / `replica_tokens`: the joined replicas' part of the step (elastic pool)."""
        if reference is not None:
            batch.ref_logprobs = reference.compute_logprobs(batch)
        chunks = self.mini_batches
        if not any(p.role == OLD for p in self.passes):
            # One pass: the update's own forward gives the pre-update log-probs (measured:
            # the separate pass was ~1/4 of a step's training time on the default run).
            current = torch.zeros(batch.input_ids.shape)
            metrics: dict[str, float] = {}
            metrics.update(engine.train_step(batch, self.loss, extra_tokens=replica_tokens,
                                             external_grads=_noting(replicas, metrics),
                                             logprobs_out=current))
            return {**logprob_mismatch(batch, current), **with_ess(metrics)}
        current = engine.compute_logprobs(batch)  # the weights before this update
        noted: dict[str, float] = {}  # the joined replicas' report
        steps = []
        size = -(-len(batch) // chunks) if len(batch) else 0
        for index in range(chunks):
            rows = slice(index * size, (index + 1) * size)
            part = batch.select(rows)
            if self.decoupled:
                # The proximal policy is the weights at the start of this optimizer step.
                part.prox_logprobs = (engine.compute_logprobs(part)
                                      if index in self._proximal_passes else current[rows])
            steps.append(engine.train_step(part, self.loss, extra_tokens=replica_tokens,
                                           external_grads=_noting(replicas, noted)))
        # means over the optimizer steps; counts add up, maxima stay maxima (metric_kinds.py)
        return with_ess({**logprob_mismatch(batch, current), **noted, **combine_parts(steps)})

    def replica_gradients(self, batch: TrainBatch, replica: GradientSource, total_tokens: int,
                          ) -> tuple[Gradients, dict[str, float]]:
        """A joined replica's share of a step, normalised over the whole step's
        `total_tokens`. One optimizer step and no KL reference: the config check keeps
        mini_batches = 1 and kl_coef = 0 with the elastic pool."""
        if self.decoupled:
            batch.prox_logprobs = replica.logprobs(batch)  # one optimizer step: prox = now
        return replica.gradients(batch, self.loss, total_tokens)


def logprob_mismatch(batch: TrainBatch, current: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probs (`current`) are from the sampler's on the same tokens."""
    mask = batch.loss_mask.bool()
    if not mask.any():
        return {"mismatch_abs_max": 0.0, "mismatch_abs_sum": 0.0, "mismatch_tokens": 0.0}
    diff = (current.cpu() - batch.old_logprobs)[mask].abs()
    return {"mismatch_abs_max": float(diff.max()), "mismatch_abs_sum": float(diff.sum()),
            "mismatch_tokens": float(mask.sum())}


def with_ess(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` plus the importance weights' `is_ess`, derived from their reduced token means
    (an ESS of the whole step, not a mean of per-micro-batch ESS)."""
    if "is_ratio_sq_mean" not in metrics:  # a loss or engine that does not report them
        return metrics
    return {**metrics, "is_ess": effective_sample_size(metrics["is_ratio_mean"],
                                                        metrics["is_ratio_sq_mean"])}


def _noting(replicas: ReplicaShare | None, metrics: dict[str, float]
            ) -> Callable[[], Gradients] | None:
    """The engine's `external_grads`: the replicas' gradients, their report noted in
    `metrics` when the engine fetches them."""
    if replicas is None:
        return None

    def fetch() -> Gradients:
        grads, report = replicas()
        metrics.update(report)
        return grads
    return fetch

"""Which log-prob forward passes the RL update runs besides its optimizer steps: the one place
that decides it, for the update itself (core/update.py `PolicyUpdate`) and for the simulator's
cost of a training step (scheduler/train_cost.py). Sans-IO: no torch, so the simulator can
import it.

- `reference`: the KL reference model's log-probs of the whole batch, when `kl_coef` > 0.
- `old`: the policy's log-probs before the update, over the whole batch. The update needs them
  apart from its first optimizer step when there are several (`mini_batches` > 1: later steps
  run on changed weights) or with the decoupled loss (they are the first step's proximal
  log-probs). With one plain optimizer step the step's own forward gives them for free.
  Left out when the old log-probs come from the rollout engine (verl's fully asynchronous
  trainer, `use_rollout_log_probs`), which only a simulated scenario says.
- `proximal`: the decoupled loss's proximal log-probs (the weights at the start of each
  optimizer step), one pass over each mini-batch after the first (the `old` pass is the
  first's), or over every mini-batch when there is no `old` pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

PassRole = Literal["reference", "old", "proximal"]
REFERENCE: PassRole = "reference"
OLD: PassRole = "old"
PROXIMAL: PassRole = "proximal"


class UpdateAlgorithm(Protocol):
    """What the choice reads of core/config.py `AlgorithmConfig`."""

    kl_coef: float
    decoupled: bool


@dataclass(frozen=True, slots=True)
class ForwardPass:
    """One log-prob forward pass: over the whole batch (`mini_batch` None) or over one
    mini-batch (its index, 0-based, in the order the update runs them)."""

    role: PassRole
    mini_batch: int | None = None


def forward_passes(algorithm: UpdateAlgorithm, mini_batches: int, *,
                   rollout_logprobs: bool = False) -> tuple[ForwardPass, ...]:
    """The log-prob passes of one update of `algorithm` in `mini_batches` optimizer steps, in
    the order the update runs them (reference, old, then the proximal ones)."""
    if mini_batches < 1:
        raise ValueError(f"mini_batches must be >= 1, got {mini_batches}")
    passes: list[ForwardPass] = []
    if algorithm.kl_coef > 0:
        passes.append(ForwardPass(REFERENCE))
    old = not rollout_logprobs and (mini_batches > 1 or algorithm.decoupled)
    if old:
        passes.append(ForwardPass(OLD))
    if algorithm.decoupled:
        first = 1 if old else 0
        passes.extend(ForwardPass(PROXIMAL, index) for index in range(first, mini_batches))
    return tuple(passes)

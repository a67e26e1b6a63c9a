"""`sim`: the training side of the simulator. A step takes the cost model's time for the
batch's tokens on `dp` data-parallel groups of `tp` devices; the batch is only counted
(`SimBatch`), never materialised."""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import Group
from ..scheduler.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class SimBatch:
    rows: int
    loss_tokens: int  # response tokens: what the loss covers
    tokens: int  # prompt + response tokens: what forward and backward process
    mean_length: float  # of a row, for attention's share of the FLOPs


def build_sim_batch(groups: list[Group], pad_id: int = 0, *, weights=None,
                    normalize_std: bool = True) -> SimBatch:
    """What `build_train_batch` would build, counted instead of filled."""
    rows = [(g, t) for g in groups for t in g.trajectories]
    if not rows:
        raise ValueError("cannot build a training batch from no trajectories")
    loss = sum(t.num_tokens for _, t in rows)
    tokens = loss + sum(len(g.prompt_ids) for g, _ in rows)
    return SimBatch(len(rows), loss, tokens, tokens / len(rows))


@dataclass(frozen=True, slots=True)
class SimTrainer:
    cost: CostModel  # with the trainer's tp
    dp: int

    def step_seconds(self, batch: SimBatch, extra_dp: float = 0.0) -> float:
        """Joined elastic replicas add `extra_dp` (possibly fractional) data-parallel groups."""
        return self.cost.train_step_seconds(batch.tokens, dp=self.dp + extra_dp,
                                            sequence_length=round(batch.mean_length))

"""`sim`: the training side of the simulator. The batch is only counted (`SimBatch`: each row's
tokens), never materialised; a step costs what scheduler/train_cost.py says for those rows laid
out as the real trainer lays them out:

- the rows go to the data-parallel ranks by the trainer's own rule (core/partition.py
  `balanced_partition` on their loss tokens, as core/batching.py `split_for_ranks` does), and
  each rank cuts its rows into `mini_batches` consecutive parts, one optimizer step each, as
  core/update.py `PolicyUpdate` does; every optimizer step waits for its slowest rank;
- the log-prob passes are the ones core/update_passes.py `forward_passes` says the configured
  algorithm runs (the same function `PolicyUpdate` asks);
- a rank runs a pass in micro-batches of at most `micro_batch_rows` rows and
  `micro_batch_tokens` tokens (0: no limit), as the training engine does (`train.
  micro_batch_size`, `train.max_tokens_per_micro_batch`); FSDP gathers the weights for each.

`SimTrainer.step_cost` returns the parts (compute, imbalance, collectives, optimizer, each
log-prob pass) so a report can show them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from ..core.partition import balanced_partition
from ..core.update_passes import ForwardPass, forward_passes
from ..protocol import Group
from ..scheduler.cost_model import CostModel
from ..scheduler.train_cost import (Checkpointing, RankRows, TrainCost, TrainLayout,
                                     TrainStepCost)

if TYPE_CHECKING:
    from ..config import EddyConfig


@dataclass(frozen=True, slots=True)
class SimBatch:
    rows: int
    loss_tokens: int  # response tokens: what the loss covers
    tokens: int  # prompt + response tokens: what forward and backward process
    mean_length: float  # of a row
    # per row, in the batch's order: prompt + response tokens, and the tokens the loss masks
    # in (the generated ones: the ranks are balanced on these, as split_for_ranks does)
    row_tokens: tuple[int, ...] = ()
    row_loss_tokens: tuple[int, ...] = ()


def build_sim_batch(groups: list[Group], pad_id: int = 0, *, weights=None,
                    normalize_std: bool = True, correction_scale=None) -> SimBatch:
    """What `build_train_batch` would build, counted instead of filled."""
    rows = [(g, t) for g in groups for t in g.trajectories]
    if not rows:
        raise ValueError("cannot build a training batch from no trajectories")
    row_tokens = tuple(len(g.prompt_ids) + t.num_tokens for g, t in rows)
    tokens = sum(row_tokens)
    return SimBatch(len(rows), sum(t.num_tokens for _, t in rows), tokens, tokens / len(rows),
                    row_tokens, tuple(t.num_generated for _, t in rows))


@dataclass(frozen=True, kw_only=True)
class SimTrainer:
    cost: CostModel  # the device, the model, the efficiency, and tp (devices per group)
    dp: int  # data-parallel groups
    # optimizer steps a training call (train.mini_batches; a streamed step's part has
    # mini_batches / stream_chunks)
    mini_batches: int = 1
    passes: tuple[ForwardPass, ...] = ()  # log-prob passes (core/update_passes.py)
    checkpointing: Checkpointing = "none"  # train.activation_checkpointing
    shard: int = 0  # FSDP shard group in devices (0: all; verl's fsdp_size)
    micro_batch_rows: int = 0  # at most this many rows a micro-batch (0: no limit)
    micro_batch_tokens: int = 0  # at most this many tokens a micro-batch (0: no limit)

    @classmethod
    def from_config(cls, config: EddyConfig, cost: CostModel, dp: int, *,
                    shard: int = 0, rollout_logprobs: bool = False) -> SimTrainer:
        """The trainer `config` describes: its `train` section's optimizer steps a call,
        activation checkpointing and micro-batches, its algorithm's log-prob passes (none for
        the old log-probs when `rollout_logprobs`: they come from the rollout engine)."""
        train = config.train
        return cls(cost=cost, dp=dp, mini_batches=train.mini_batches_per_call,
                   passes=forward_passes(config.algorithm, train.mini_batches_per_call,
                                         rollout_logprobs=rollout_logprobs),
                   checkpointing=train.activation_checkpointing, shard=shard,
                   micro_batch_rows=train.micro_batch_size,
                   micro_batch_tokens=train.max_tokens_per_micro_batch)

    @cached_property
    def train_cost(self) -> TrainCost:
        layout = TrainLayout(dp=self.dp, tp=self.cost.tp, shard=self.shard,
                             checkpointing=self.checkpointing, param_bytes=self.cost.dtype_bytes)
        return TrainCost(self.cost.accelerator, self.cost.model, layout,
                         self.cost.efficiency.train_mfu)

    def step_seconds(self, batch: SimBatch, extra_dp: float = 0.0) -> float:
        """Joined elastic replicas add `extra_dp` (possibly fractional) data-parallel groups."""
        return self.step_cost(batch, extra_dp).total_s

    def step_cost(self, batch: SimBatch, extra_dp: float = 0.0) -> TrainStepCost:
        """The step's parts. Joined elastic replicas (`extra_dp` groups' worth) take that share
        of every rank's rows; the imbalance stays that of the trainer's own ranks."""
        row_tokens = batch.row_tokens or (round(batch.mean_length),) * batch.rows
        loss_tokens = batch.row_loss_tokens or row_tokens
        ranks = [[row_tokens[i] for i in rows]
                 for rows in balanced_partition(list(loss_tokens), self.dp)]
        mini = [self._rows(part) for part in self._mini_batches(ranks)]
        whole = self._rows(ranks)
        logprob = [(p.role, whole if p.mini_batch is None else mini[p.mini_batch])
                   for p in self.passes]
        return self.train_cost.step(mini, logprob, share=self.dp / (self.dp + extra_dp))

    def _mini_batches(self, ranks: list[list[int]]) -> list[list[list[int]]]:
        """Each rank's rows cut into `mini_batches` consecutive parts, as PolicyUpdate cuts
        them: per optimizer step, every rank's part."""
        sizes = [-(-len(rank) // self.mini_batches) for rank in ranks]
        return [[rank[index * size:(index + 1) * size] for rank, size in zip(ranks, sizes)]
                for index in range(self.mini_batches)]

    def _rows(self, ranks: list[list[int]]) -> RankRows:
        """A pass over these per-rank rows, in as many micro-batches as its busiest rank
        needs."""
        def micro_batches(rank: list[int]) -> int:
            by_rows = -(-len(rank) // self.micro_batch_rows) if self.micro_batch_rows else 1
            by_tokens = -(-sum(rank) // self.micro_batch_tokens) if self.micro_batch_tokens else 1
            return max(by_rows, by_tokens, 1)

        return RankRows(tuple(tuple(rank) for rank in ranks),
                        max(micro_batches(rank) for rank in ranks))

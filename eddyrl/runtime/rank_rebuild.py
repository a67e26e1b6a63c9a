"""A trainer rank's part in rebuilding the trainer after another rank was lost (the driver's
part: runtime/ray/trainer_rebuild.py).

Two calls, in order, on every rank that goes on (with buddy copies; without them, one:
`rejoin_published`, below):
- `recovery_copies`: a survivor's own last buddy copy and its ward's (engines/training/buddy.py),
  left in Ray's object store; the driver gets only their versions and shapes (`CopyInfo`);
- `rejoin`: leave the broken group, join the new one at its rendezvous (a new name: a late
  message of the old group cannot reach it), build a fresh engine, and load this rank's shard
  of the last completed step, cut from the old world's copies (`shard_copy.reshard`; only the
  copies it overlaps are fetched). A replacement rank, new to the run, takes only this call.

Without buddy copies (`train.buddy_replication = false`) every member takes
`rejoin_published`: the same group change, then the run's last checkpoint (optimizer state,
generators) and over its weights the rollout's published ones (runtime/ray/published_rebuild.py).

A mixin of `TrainerRank` (trainer_rank.py), which holds the engine and starts it (`start`).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

from ..engines.training.shard_copy import ShardCopy, Shapes, reshard, shapes_of
from ..hal import distributed


@dataclass(frozen=True)
class CopyInfo:
    """What a survivor holds (`recovery_copies`): the version and shapes of its own copy and
    of its ward's (None where it has none). Not its engine's version: that may be past the
    copies, inside the interrupted step, and the rebuild goes back to the copies."""

    rank: int
    own_version: int | None
    own_shapes: Shapes | None
    ward: int | None
    ward_version: int | None
    ward_shapes: Shapes | None


@dataclass(frozen=True)
class RebuildPlan:
    """What `rejoin` loads: `pieces[i]` is a Ray reference to old rank i's copy at `version`
    (nested here, so that Ray hands the reference over and the rank fetches only what it
    needs), `shapes[i]` its shapes; `rng_from`, the old rank whose generators this rank takes
    (its own, or the lost one's for its replacement)."""

    pieces: list[Any]
    shapes: list[Shapes]
    rng_from: int
    version: int


@dataclass(frozen=True)
class PublishedPlan:
    """What `rejoin_published` loads: `weights[0]`, a Ray reference to the whole weights a
    rollout worker gave back (nested, so that only rank 0 fetches them: the others get their
    shards by broadcast), of `version`; `checkpoint`, the run's last checkpoint no later than
    it (a path, or its files shipped where the run directory is not shared), or None."""

    weights: list[Any]
    version: int
    checkpoint: Any


class RankRebuild:
    engine: Any
    reference: Any
    platform: Any
    rank: int
    world: int
    start: Any  # TrainerRank.start(rendezvous, snapshot)
    load: Any  # TrainerRank.load(checkpoint)

    def recovery_copies(self) -> tuple[CopyInfo, ShardCopy | None, ShardCopy | None]:
        """Called with `num_returns=3`: the info for the driver, the two copies for the
        object store (`engine.recovery_copies`)."""
        own, ward = self.engine.recovery_copies()
        info = CopyInfo(self.rank, own.version if own else None, shapes_of(own) if own else None,
                        ward.rank if ward else None, ward.version if ward else None,
                        shapes_of(ward) if ward else None)
        return info, own, ward

    def rejoin(self, rendezvous: str, rank: int, world: int, plan: RebuildPlan) -> None:
        """Leave the old group (if this rank was in it), join the new one as `rank` of
        `world`, and load this rank's shard of the plan's version."""
        import ray

        self._move_to(rendezvous, rank, world)
        copy = reshard(plan.shapes, lambda old: ray.get(plan.pieces[old]), world, rank,
                       plan.rng_from, plan.version)
        self.engine.restore_shard(copy)
        del copy
        self.engine.snapshot()  # the new ring's first copies, of the state just loaded

    def rejoin_published(self, rendezvous: str, rank: int, world: int,
                         plan: PublishedPlan) -> bool:
        """`rejoin`'s group change, then the state without copies: the checkpoint's (or a
        fresh optimizer's), with the published weights over it. Returns whether the weights
        came in the trainer's own dtypes (rank 0's answer; True on the others)."""
        import ray

        self._move_to(rendezvous, rank, world)
        if plan.checkpoint is not None:
            self.load(plan.checkpoint)
        weights = ray.get(plan.weights[0]) if rank == 0 else {}
        exact = self.engine.load_full_weights(weights, plan.version)
        del weights
        return exact

    def _move_to(self, rendezvous: str, rank: int, world: int) -> None:
        """Leave the old group (if this rank was in it) and build a fresh engine as `rank` of
        `world` in the new one, its state still the model files': the caller loads it."""
        self._leave()
        self.rank, self.world = rank, world
        self.start(rendezvous, snapshot=False)

    def _leave(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        engine.abandon()
        # On a cluster this rank joined the group itself (`start`: a tcp store), so the engine
        # left it be: it is left here (a no-op where the engine owned it and left already)
        distributed.abandon()
        servers = getattr(self, "_servers", {})  # the old group's store, where this rank served it
        old = servers.pop(getattr(self, "_group_rendezvous", None), None)
        if old is not None:
            old.close()
        self.engine = self.reference = None
        del engine
        gc.collect()  # the old engine's device memory, before the new one takes its own
        self.platform.release_memory(("weights",))

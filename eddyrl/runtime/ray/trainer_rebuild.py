"""The trainer rebuilt in place after a lost rank (`RayRuntime.recover_trainer`), at the state
of its last completed step, so that the interrupted call runs again (core/trainer_recovery.py).

1. Why not: `train.on_rank_loss = stop`, or one rank (no survivor): the loss ends the run,
   saying which.
2. The lost rank's process is ended (`ray.kill`): one that stopped taking part still holds its
   device, and a late message of it must not reach anyone.
3. Each survivor reports its copies (`TrainerRank.recovery_copies`): its own last one and the
   one it keeps of its ward. The rebuild needs every old rank's copy at the version the
   trainer's last completed call left (`RayRuntime.trainer_version`): the survivors' own, and
   the lost rank's from its buddy (rank + 1). Copies are taken at a step's end only, so a
   survivor's engine may be past that version (the interrupted step's optimizer steps) while
   its copy is not. A copy of a later version (the step had finished on that rank, its copy
   begun, before the loss was known: rerunning it would train its batch twice), or a buddy
   whose copy of the lost rank was still arriving, makes the rebuild impossible: the run ends,
   saying so. Without copies (`train.buddy_replication = false`) the state is the rollout's
   published weights of that version and the last checkpoint's optimizer instead
   (published_rebuild.py): not bit for bit unless that checkpoint is of that version.
4. The members: with `replace`, a new actor in the lost rank's bundle (its node if alive, else
   wherever Ray finds the device; colocated, the device it shares with its rollout worker),
   given `REPLACEMENT_WAIT_S` to start; the survivors alone (`shrink`, or no replacement in
   time), renumbered in order. Colocated, the rollout engines sleep first: the new engines
   take the shared devices.
5. A new group: a new rendezvous name, `trainer_group.g<generation>` (a new file on one
   machine, a new store on a new port across machines), so nothing of the old group can join
   it. Every member leaves the old group, joins the new one and loads its shard, cut from the
   old world's copies (`TrainerRank.rejoin`, `shard_copy.reshard`).
6. The driver's view follows: the ranks' calls (their places, for the next loss's report),
   their devices, the weight channel (its sender, rank 0, may be new).

With a replacement the world is as before and each rank's shard is its copy, bit for bit: the
rerun step computes what the lost attempt would have. Shrunk, the state is the same but the
world is smaller: the next steps reduce over fewer ranks (equal in exact arithmetic, not
bit for bit).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Callable

from ...errors import WorkerLost
from ...runtime_protocol import TrainerRankLost
from ..rank_rebuild import CopyInfo, RebuildPlan
from .published_rebuild import published_plan

if TYPE_CHECKING:
    from .runtime import RayRuntime

log = logging.getLogger(__name__)

# How long a replacement rank may take to start (Ray placing it, the process, its imports)
# before the group shrinks to the survivors instead; at most cluster.timeout_s.
REPLACEMENT_WAIT_S = 120.0


async def rebuild_trainer(runtime: RayRuntime, lost: TrainerRankLost) -> dict[str, float]:
    import ray

    began = runtime.now()
    why = why_not_in_place(runtime, lost)
    if why:
        raise lost.not_recovered(why)
    world = len(runtime.trainers)
    ray.kill(runtime.trainers[lost.rank], no_restart=True)
    survivors = [r for r in range(world) if r != lost.rank]
    version = runtime.trainer_version
    if runtime.settings.trainer.train.buddy_replication:
        rejoin, recorded = await _from_copies(runtime, lost, survivors, version)
    else:  # no copies: the rollout's weights, a checkpoint's optimizer (published_rebuild.py)
        plan, recorded = await published_plan(runtime, lost, version)

        def rejoin(actor: Any, rendezvous: str, rank: int, world: int, old: int) -> Any:
            return actor.rejoin_published.remote(rendezvous, rank, world, plan)
    members = [(runtime.trainers[r], r) for r in survivors]  # (actor, old rank: generators)
    replacement = None
    if runtime.settings.trainer.train.on_rank_loss == "replace":
        replacement = await _replacement(runtime, lost.rank, world)
        if replacement is not None:
            members.insert(lost.rank, (replacement, lost.rank))
    if runtime.colocated:
        await _devices_to_the_trainer(runtime)
    new_world = len(members)
    new_sender = members[0][0] is not runtime.trainers[0]  # old rank 0 lost: a new one sends
    runtime.trainers = [actor for actor, _ in members]
    runtime.trainer_generation += 1
    rendezvous = await asyncio.to_thread(
        runtime._rendezvous, f"trainer_group.g{runtime.trainer_generation}", new_world)
    exact_weights = await runtime.calls.call_all([
        (f"trainer rank {rank}", f"rejoin (group generation {runtime.trainer_generation})",
         rejoin(actor, rendezvous, rank, new_world, old))
        for rank, (actor, old) in enumerate(members)])
    await _follow(runtime, reconnect=new_sender)
    # the state is the lost attempt's starting state bit for bit: copies always; without
    # them, only a checkpoint of that very version and weights in the trainer's dtypes
    exact = recorded.get("trainer_optimizer_version", version) == version \
        and all(e is not False for e in exact_weights)
    return {"trainer_world": float(new_world), "trainer_replaced": float(replacement is not None),
            "trainer_state_exact": float(exact), **recorded,
            "trainer_rebuild_s": runtime.now() - began}


async def _from_copies(runtime: RayRuntime, lost: TrainerRankLost, survivors: list[int],
                       version: int) -> tuple[Callable[..., Any], dict[str, float]]:
    """The buddy copies of `version` (the survivors' own, the lost rank's on its buddy) and
    how a member of the new group loads its shard of them (`TrainerRank.rejoin`)."""
    world = len(survivors) + 1
    refs = {r: runtime.trainers[r].recovery_copies.options(num_returns=3).remote()
            for r in survivors}
    infos = await runtime.calls.call_all([(f"trainer rank {r}", "recovery copies", refs[r][0])
                                          for r in survivors])
    version, why = common_version(lost.rank, world, dict(zip(survivors, infos)), version)
    if why:
        raise lost.not_recovered(why)
    by_rank: dict[int, CopyInfo] = dict(zip(survivors, infos))
    keeper = (lost.rank + 1) % world
    pieces = [refs[keeper][2] if r == lost.rank else refs[r][1] for r in range(world)]
    shapes = [by_rank[keeper].ward_shapes if r == lost.rank else by_rank[r].own_shapes
              for r in range(world)]

    def rejoin(actor: Any, rendezvous: str, rank: int, new_world: int, old: int) -> Any:
        return actor.rejoin.remote(rendezvous, rank, new_world,
                                   RebuildPlan(pieces, shapes, old, version))
    return rejoin, {}


def why_not_in_place(runtime: RayRuntime, lost: TrainerRankLost) -> str:
    """Why `lost` cannot be recovered in place; empty where it can (so far as the settings
    tell: the copies are checked next)."""
    train = runtime.settings.trainer.train
    if train.on_rank_loss == "stop":
        return "train.on_rank_loss = stop"
    if len(runtime.trainers) < 2:
        return "it was the only trainer rank: no survivor holds the state"
    return ""


def common_version(lost: int, world: int, infos: dict[int, CopyInfo],
                   version: int) -> tuple[int, str]:
    """`version`, the trainer's after its last completed call, if every old rank's copy is of
    it (each survivor's own, the lost rank's on its buddy); else why not. A survivor's engine
    may be past it (an optimizer step of the interrupted call): its copy, taken only at a
    step's end (`TrainerRank.train`), is not. A copy past it means the interrupted step had
    finished on that rank: running it again would train its batch twice."""
    for rank, info in sorted(infos.items()):
        if info.own_version is None:
            return -1, (f"trainer rank {rank} holds no copy of its state (its engine keeps "
                        "none)")
        if info.own_version != version:
            return -1, (f"trainer rank {rank}'s last copy is of version {info.own_version}, "
                        f"the trainer's last completed step left version {version}: the "
                        "interrupted step had finished on it, and running it again would "
                        "train its batch twice")
    keeper = infos[(lost + 1) % world]
    if keeper.ward != lost or keeper.ward_version != version:
        held = "none" if keeper.ward_version is None else f"version {keeper.ward_version}"
        return -1, (f"trainer rank {keeper.rank} keeps rank {lost}'s copy and holds {held}, "
                    f"not version {version} (the copy was arriving when the rank was lost)")
    return version, ""


async def _devices_to_the_trainer(runtime: RayRuntime) -> None:
    """Colocated: the rollout engines sleep before the new group builds its engines on the
    devices they share (mid-step they sleep already; in a weight export or after a checkpoint
    they may be awake). The call that runs again hands the devices on as it always does."""
    actors = runtime.actors
    results = await asyncio.gather(*(
        actors.call(i, "sleep (a trainer rebuilt on the shared devices)",
                    lambda actor: actor.sleep.remote()) for i in actors.live()),
        return_exceptions=True)
    for result in results:  # a worker lost meanwhile is the rollout's to find, on its next call
        if isinstance(result, BaseException) and not isinstance(result, WorkerLost):
            raise result


async def _replacement(runtime: RayRuntime, rank: int, world: int) -> Any | None:
    """A new actor for `rank`, started, or None (ended) if it did not start in time."""
    import ray

    runtime.trainer_replacements = getattr(runtime, "trainer_replacements", 0) + 1
    actor = runtime.new_trainer(rank, world, runtime.trainer_replacements)
    wait_s = min(REPLACEMENT_WAIT_S, runtime.settings.cluster.timeout_s)
    try:
        await asyncio.wait_for(runtime.calls.call(f"trainer rank {rank} (replacement)",
                                                  "start", actor.whereabouts.remote()), wait_s)
        return actor
    except Exception as exc:  # not placed in time, or its start failed: shrink instead
        log.warning(f"a replacement for trainer rank {rank} did not start ({exc!r:.300}); "
                    "the trainer goes on with the surviving ranks")
        ray.kill(actor, no_restart=True)
        return None


async def _follow(runtime: RayRuntime, reconnect: bool) -> None:
    """The driver's view of the new group: its ranks' places, devices and nodes, and, with
    `reconnect` (rank 0 is a new actor), the weight channel from its rank 0. Rank 0 alone of
    the trainer is in the channel, on a group of its own that the trainer group's rebuild
    leaves be: a surviving rank 0 keeps it, and the rebuild does not wait on a rollout
    worker's replacement starting meanwhile (measured across hosts: seconds)."""
    trainers = list(enumerate(runtime.trainers))
    places = await runtime.calls.call_all([(f"trainer rank {r}", "whereabouts",
                                            t.whereabouts.remote()) for r, t in trainers])
    runtime.ranks = runtime._trainer_calls(places)
    if runtime.devices is not None:
        runtime.devices["trainer"] = await runtime.calls.call_all(
            [(f"trainer rank {r}", "device", t.device_binding.remote()) for r, t in trainers])
    if runtime.placement is not None:
        runtime.placement["trainer"] = [place["node"] for place in places]
    if reconnect:
        await asyncio.to_thread(runtime._connect_weight_channel)

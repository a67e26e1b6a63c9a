"""Calls to the trainer ranks together, and a lost rank found among their failures.

A trainer rank lost during a call shows in two ways, in either order: its own call fails with
Ray's actor death (a second or so after its process ends, on a local Ray), and the other
ranks' calls fail in the collective they were in (gloo: the connection closed at once; NCCL /
HCCL: at the group's timeout, `train.collective_timeout_s`). A rank alive but no longer taking
part (stopped, stuck in a kernel) shows only the second way: the others time out while its
own call goes on. `TrainerCalls.call_all` waits for the first failure and reports the rank
that is lost, not the first rank to fail:

- an actor death: that rank, at once, as `TrainerRankLost` (`ACTOR_DIED`, Ray's reason);
- a collective's timeout: once the other waiting ranks' timeouts are in (`TIMEOUTS_QUIET_S`
  with none), the rank whose call neither failed nor finished is the lost one
  (`COLLECTIVE_TIMED_OUT`);
- another error: the calls still running get `DEATH_GRACE_S` to show a death (that rank is
  the lost one; the others failed because of it); with none, the error (one of the step
  itself, the driver's deadline `cluster.timeout_s`) is raised as `RayCalls` reported it.

A gradient replica of the elastic pool lost mid-step (a rollout worker's process) shows as
every rank's call failing, each with the replica's death as the cause of its own error (the
ranks fetch its gradients): not a rank's death. `dead_replicas` finds it among the replicas'
calls; the runtime reruns the step without it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ...errors import RayLost
from ...hal import distributed
from ...runtime_protocol import ACTOR_DIED, COLLECTIVE_TIMED_OUT, TrainerRankLost
from .calls import RayCalls
from .errors import is_actor_death, death_fields, death_reason

# How long the other ranks' calls may take to show a death after one rank's call failed: Ray
# fails a dead actor's calls a second or so after its process ends; this is ample on a loaded
# machine, and only delays an error that is not a loss.
DEATH_GRACE_S = 15.0
# After a collective's timeout, the other waiting ranks' timeouts follow within the spread of
# their arrivals at that collective: none for this long, and the ranks still running are the
# ones that took no part.
TIMEOUTS_QUIET_S = 5.0


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a trainer rank runs, as it said at start (`TrainerRank.whereabouts`)."""

    node: str | None = None
    node_id: str | None = None
    pid: int | None = None


class TrainerCalls:
    def __init__(self, calls: RayCalls, places: list[RankPlace],
                 collective_timeout_s: float, grace_s: float = DEATH_GRACE_S) -> None:
        self.calls = calls
        self.places = places
        self.collective_timeout_s = collective_timeout_s
        self.grace_s = grace_s

    async def call_all(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Each (rank, what, ref) together; their results in order, or the lost rank."""
        tasks = [asyncio.ensure_future(self.calls.call(f"trainer rank {rank}", what, ref))
                 for rank, what, ref in calls]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if not _failed(done):
                return [task.result() for task in tasks]
            if pending and not any(self._died(t) for t in done):
                # the others' calls: a death among them is the loss behind this failure. After
                # a timeout, only until the other waiting ranks' timeouts are in (a rank that
                # died would have shown it long before): the rank left is the one lost.
                quiet_s = TIMEOUTS_QUIET_S if any(self._timed_out(t) for t in done) else None
                await _settle(pending, self._died, min(self.grace_s, quiet_s or self.grace_s),
                              self.grace_s)
            raise self._lost(calls, tasks)
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()  # retrieved: a second failure is not logged at exit

    @staticmethod
    def _died(task: asyncio.Future) -> bool:
        if not task.done() or task.cancelled() or task.exception() is None:
            return False
        return is_actor_death(task.exception().__cause__)  # RayCalls raises from Ray's error

    @staticmethod
    def _timed_out(task: asyncio.Future) -> bool:
        """Whether the rank's call failed in a collective that waited past its timeout (the
        exception its method raised is the Ray error's `cause`)."""
        if not task.done() or task.cancelled() or task.exception() is None:
            return False
        return distributed.timed_out(getattr(task.exception().__cause__, "cause", None))

    def _lost(self, calls: list[tuple[int, str, Any]], tasks: list[asyncio.Future]
              ) -> BaseException:
        """The error to raise: the lost rank, or the first failure as it was."""
        first = next(t.exception() for t in tasks if t.done() and not t.cancelled()
                     and t.exception() is not None)
        if isinstance(first, RayLost):
            return first
        dead = [(call, task) for call, task in zip(calls, tasks) if self._died(task)]
        if dead:
            self.calls.raise_if_ray_lost(first)  # every actor died with the raylet: that
            (rank, what, _), task = dead[0]
            cause = task.exception().__cause__
            text = getattr(cause, "error_msg", None) or str(cause)
            return self._event(rank, what, ACTOR_DIED, death_reason(text), death_fields(text))
        timed_out = [rank for (rank, _, _), task in zip(calls, tasks) if self._timed_out(task)]
        silent = [(rank, what) for (rank, what, _), task in zip(calls, tasks)
                  if not task.done()]
        if timed_out and silent:
            rank, what = silent[0]
            waited = ", ".join(str(r) for r in timed_out)
            return self._event(rank, what, COLLECTIVE_TIMED_OUT,
                               f"trainer rank{'s' if len(timed_out) > 1 else ''} {waited} "
                               f"waited train.collective_timeout_s = "
                               f"{self.collective_timeout_s:g} s for it in a collective; it "
                               "is alive but took no part", {})
        return first

    def _event(self, rank: int, what: str, cause: str, detail: str,
               said: dict[str, str]) -> TrainerRankLost:
        place = self.places[rank] if rank < len(self.places) else RankPlace()
        pid = place.pid if place.pid is not None else (
            int(said["pid"]) if said.get("pid", "").isdigit() else None)
        return TrainerRankLost(rank, what, cause, detail, node=place.node or said.get("ip"),
                               node_id=place.node_id, pid=pid)


def dead_replicas(refs: dict[int, Any]) -> dict[int, str]:
    """The replicas (rollout worker -> why) whose gradient call failed because the process is
    gone. A rank failed fetching them, so a dead one's failure is already known here, the
    references' owner: nothing is waited for, and a replica still computing is not lost."""
    import ray

    if not refs:
        return {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
    dead = {}
    for worker, ref in refs.items():
        if ref not in ready:
            continue
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError as error:
            if is_actor_death(error):
                dead[worker] = death_reason(getattr(error, "error_msg", None) or str(error))
    return dead


def _failed(done: set[asyncio.Future]) -> bool:
    return any(not t.cancelled() and t.exception() is not None for t in done)


async def _settle(pending: set[asyncio.Future], died, quiet_s: float, grace_s: float) -> None:
    """Until one of `pending` ends in a death, all have ended, none has ended for `quiet_s`,
    or `grace_s` passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while pending:
        left = min(quiet_s, deadline - loop.time())
        if left <= 0:
            return
        done, pending = await asyncio.wait(pending, timeout=left,
                                           return_when=asyncio.FIRST_COMPLETED)
        if not done or any(died(t) for t in done):
            return

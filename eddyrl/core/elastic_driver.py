"""The elastic pool at work: the controller's side of Libra's join/leave protocol
(`scheduler/elastic.py`).

At each step boundary the driver
1. asks the adaptive driver (`adaptive_driver.py`) for its split decision, with what the pool
   allows (borrow or return one worker), performs it, and any move pinned in the config
   (`elastic.schedule`);
2. carries every move forward: it performs the protocol's actions through the runtime and the
   streaming rollout, and reports back what finished since the last boundary;
3. names the joined replicas whose gradients count in the next step (`replicas`).

A replica whose process died mid-step was dropped from that step by the runtime, which reran it
on the core ranks alone and names it in the step's metrics (`replicas_lost`: worker -> why).
At the boundary the pool forgets its move (`ElasticPool.lost`) and the rollout replaces the
process as for any lost rollout worker (`StreamingRollout.worker_lost`); nothing is asked of
the dead process (no `leave_training`).

Nothing here makes a step wait for a worker to be lent or given back (Libra's "worker
migration"; in Eddy migration is only a request's move, `moves.py`). What takes time —
sleeping an engine and building a replica, waking it and loading weights — runs as background
tasks whose results are picked up at a later boundary; the state fetch is the weight sync every
rollout worker gets anyway. On the critical path are only cheap queries (a replica's weight
version).

Pool ids: rollout worker i is id i; trainer rank r (a core replica, never moved) is
id num_rollout_workers + r.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, WorkerLost
from ..runtime_protocol import ElasticRuntime
from ..scheduler.adaptive import Change
from ..scheduler.elastic import Action, Do, ElasticPool, PoolError, Role, State
from .adaptive_driver import AdaptiveDriver, NoAdaptive
from .rollout import StreamingRollout


JOINING = (State.REQUESTED, State.FETCHING_STATE, State.ZERO_SYNC, State.ACTIVATING)


def parse_schedule(entries: list[str], rollout_workers: int) -> dict[int, list[tuple[str, int]]]:
    """`["3 join 1", "6 leave 1"]` -> {3: [("join", 1)], 6: [("leave", 1)]}: after step 3,
    rollout worker 1 is asked to join training; after step 6, to leave."""
    schedule: dict[int, list[tuple[str, int]]] = {}
    for entry in entries:
        parts = entry.split()
        if len(parts) != 3 or parts[1] not in ("join", "leave") or \
                not (parts[0].isdigit() and parts[2].isdigit()):
            raise ConfigError(f"elastic.schedule entry {entry!r}: expected '<step> join|leave "
                              "<rollout worker>', e.g. '3 join 1'")
        step, verb, worker = int(parts[0]), parts[1], int(parts[2])
        if worker >= rollout_workers:
            raise ConfigError(f"elastic.schedule entry {entry!r}: rollout worker {worker} does "
                              f"not exist (rollout.num_workers = {rollout_workers})")
        schedule.setdefault(step, []).append((verb, worker))
    return schedule


@dataclass
class ElasticDriver:
    runtime: ElasticRuntime  # eddyrl.build checks it is Elastic
    rollout: StreamingRollout
    pool: ElasticPool
    schedule: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    # asked for split decisions at each boundary; shares `events` with this driver
    adaptive: AdaptiveDriver | NoAdaptive = field(default_factory=NoAdaptive)
    _tasks: dict[int, tuple[asyncio.Task, int, str]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_rollout(self) -> int:
        return self.rollout.num_workers

    def replicas(self) -> list[int]:
        """Rollout workers whose replica gradients count in the next step."""
        return [w for w in self.pool.contributors() if w < self.num_rollout]

    async def boundary(self, step: int, version: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """After step `step` (the trainer now at `version`, weights synced): decide, report,
        act. Returns metrics for the step's record."""
        for worker, why in (metrics.get("replicas_lost") or {}).items():
            await self._lost(int(worker), why)
        await self._collect_finished()
        await self._report_fetched(version)
        for action in self.pool.step_boundary(step):
            await self._perform(action)
        await self._decide(step, metrics)
        for verb, worker in self.schedule.get(step, []):
            await self._request(verb, worker, f"schedule: {step} {verb} {worker}")
        await self._advance_lent()
        return {"elastic_replicas": len(self.replicas()),
                "elastic_borrowed": len(self.pool.borrowed()),
                "elastic_states": {str(w): self.pool.state(w).value
                                   for w in range(self.num_rollout)
                                   if self.pool.state(w) is not State.ROLLOUT}}

    def report(self) -> dict[str, Any]:
        """For the run summary: requests and decisions with reasons, and every transition."""
        return {"events": list(self.events),
                "timeline": [t._asdict() | {"from_state": t.from_state.value,
                                            "to_state": t.to_state.value}
                             for t in self.pool.timeline]}

    async def drain(self) -> None:
        """Let background moves finish (end of run): workers end up where their moves lead."""
        for task, _, _ in list(self._tasks.values()):
            await asyncio.gather(task, return_exceptions=True)
        await self._collect_finished()

    # -- decisions ---------------------------------------------------------------------------

    async def _decide(self, step: int, metrics: dict[str, Any]) -> None:
        decision = await self.adaptive.decide(step, metrics,
                                              can_borrow=bool(self.pool.joinable()),
                                              can_return=bool(self.pool.leavable()))
        if decision is None:
            return
        if decision.change is Change.BORROW:
            # the least busy serving worker: its requests move away fastest
            serving = self.rollout.serving()  # not one being replaced
            candidates = [w for w in self.pool.joinable() if serving[w]]
            if not candidates:
                return
            worker = min(candidates, key=lambda w: (self.rollout.running_on(w), w))
            await self._request("join", worker, f"adaptive: {decision.reason}")
        elif decision.change is Change.RETURN:
            await self._request("leave", self.pool.leavable()[0],
                                f"adaptive: {decision.reason}")

    async def _request(self, verb: str, worker: int, reason: str) -> None:
        """Ask the pool for a move; a refusal (limits, or the worker mid-move) is recorded
        and the run goes on."""
        event = {"step": self.pool.step, "worker": worker, "request": verb, "reason": reason}
        self.events.append(event)
        serving = self.rollout.serving()
        if verb == "join" and serving[worker] and sum(serving) <= 1:
            # the pool counts workers, not the lost ones still being replaced: the rollout does
            event["refused"] = (f"rollout worker {worker} is the only one serving now (the "
                                "others are lost or lent)")
            return
        if verb == "join" and not serving[worker] and self.pool.state(worker) is State.ROLLOUT:
            event["refused"] = f"rollout worker {worker} was lost and is being replaced"
            return
        try:
            if verb == "join":
                action = self.pool.request_join(worker)
            elif self.pool.state(worker) in JOINING:
                action = self.pool.cancel(worker)  # not trained yet: undo the join instead
                event["cancelled_join"] = True
            else:
                action = self.pool.request_leave(worker)
        except PoolError as refusal:
            event["refused"] = str(refusal)
            return
        await self._perform(action)

    # -- actions -----------------------------------------------------------------------------

    async def _lost(self, worker: int, why: str) -> None:
        """`worker`'s process died as a replica: whatever its move, it is over."""
        self.events.append({"step": self.pool.step, "worker": worker, "lost": why})
        if self.pool.state(worker) is not State.ROLLOUT:  # else the rollout's own to replace
            await self._perform(self.pool.lost(worker, why))

    async def _perform(self, action: Action) -> None:
        worker = action.worker
        if action.kind is Do.SLEEP_ENGINE:
            await self.rollout.lend(worker)  # its requests move; the join starts once drained
        elif action.kind in (Do.DETACH_AND_WAKE, Do.ABORT_FETCH_AND_WAKE,
                             Do.DROP_GRADIENTS_AND_WAKE, Do.WAKE_ENGINE_AND_LOAD):
            self._start(worker, action.generation, "leave",
                        self.runtime.leave_training(worker))
        elif action.kind is Do.RETURN_TO_ROLLOUT:
            pass  # done by whoever reported the weights loaded (it knows the hosted version)
        elif action.kind is Do.REPLACE_WORKER:
            # a new process, which serves once it has the published weights (core/moves.py);
            # a move's task still running on the dead one reports a stale generation
            self.rollout.worker_lost(worker, action.reason)
        # FETCH_STATE: the next weight sync fetches it; START_ZERO_GRADS, ACTIVATE,
        # RELEASE_AT_BOUNDARY, NONE: only who contributes changes, which `replicas` reads.

    async def _advance_lent(self) -> None:
        """Lent workers whose rollout requests have all finished start joining (engine sleep and
        replica build, in the background)."""
        for worker in range(self.num_rollout):
            if self.pool.state(worker) is State.REQUESTED and worker not in self._tasks \
                    and self.rollout.running_on(worker) == 0:
                self._start(worker, self.pool.generation(worker), "join",
                            self.runtime.join_training(worker))

    def _start(self, worker: int, generation: int, what: str, call) -> None:
        self._tasks[worker] = (asyncio.ensure_future(call), generation, what)

    async def _collect_finished(self) -> None:
        for worker, (task, generation, what) in list(self._tasks.items()):
            if not task.done():
                continue
            del self._tasks[worker]
            error = task.exception()
            if isinstance(error, WorkerLost):  # its process died mid-move (joining, leaving)
                await self._lost(worker, str(error))
                continue
            if error is not None:
                self.events.append({"step": self.pool.step, "worker": worker,
                                    "failed": what, "error": str(error)})
                action = self.pool.failed(worker, f"{what}: {error}", generation)
                if action is not None:
                    await self._perform(action)
                continue
            if what == "join":
                action = self.pool.engine_slept(worker, generation)
            else:
                action = self.pool.weights_loaded(worker, generation)
                if action is not None and action.kind is Do.RETURN_TO_ROLLOUT:
                    self.rollout.take_back(worker, task.result())
            if action is not None:
                await self._perform(action)

    async def _report_fetched(self, version: int) -> None:
        """A replica holding the trainer's current weights has fetched its state."""
        for worker in range(self.num_rollout):
            if self.pool.state(worker) is State.FETCHING_STATE:
                try:
                    fetched = await self.runtime.replica_version(worker)
                except WorkerLost as lost:
                    await self._lost(worker, str(lost))
                    continue
                if fetched >= version:
                    action = self.pool.state_fetched(worker, self.pool.generation(worker))
                    if action is not None:
                        await self._perform(action)


def build_pool(num_rollout: int, num_train: int, config) -> ElasticPool:
    """Rollout workers 0..n-1, trainer ranks after them as the fixed core."""
    workers = {i: Role.ROLLOUT for i in range(num_rollout)}
    workers.update({num_rollout + r: Role.TRAIN for r in range(num_train)})
    return ElasticPool(workers, [num_rollout + r for r in range(num_train)], config)


class NoElastic:
    """The elastic pool switched off: no replicas; the adaptive driver, if on, still decides
    (plans only: nothing can be lent)."""

    def __init__(self, adaptive: AdaptiveDriver | NoAdaptive | None = None) -> None:
        self.adaptive = adaptive or NoAdaptive()

    def replicas(self) -> list[int]:
        return []

    async def boundary(self, step: int, version: int, metrics: dict[str, Any]
                       ) -> dict[str, Any]:
        await self.adaptive.decide(step, metrics)
        return {}

    async def drain(self) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {}

"""The rollout workers' Ray actors, as one object: `RolloutActors` owns their handles, each
worker's incarnation (how many processes it has had), and the set of workers lost and being
replaced; nothing else writes them. A dead worker's calls become `WorkerLost` for the rollout
(which puts its requests back), and `replace_worker` starts a new process under the same index,
has it rejoin the weight channel and gives it the published weights (`PublishedWeights`).

The weight channel spans the trainer ranks too, so it is the runtime's (`runtime.py`): a
replacement rejoins it through the two callables the runtime gives the actor set."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from ...errors import WorkerCallError, WorkerLost
from .calls import RayCalls

REPLACEMENT_ATTEMPTS = 3  # new processes tried for a lost rollout worker before giving up


def actor_died(exc: BaseException) -> bool:
    """Whether a failed worker call failed because the actor's process is gone."""
    import ray

    return isinstance(exc.__cause__, ray.exceptions.RayActorError)


def failed_to_start(exc: BaseException) -> bool:
    """Whether the actor's `__init__` raised (vLLM not installed, a bad engine setting): a new
    process with the same settings fails the same way, so it is reported, not retried."""
    return actor_died(exc) and bool(getattr(exc.__cause__, "actor_init_failed", False))


class PublishedWeights:
    """Which weights a replacement may take, and when. From a train step until its weight sync
    the trainer's weights are ahead of the published version: an export for a replacement
    waits for them to be published (it must hand out the version the rollout knows), and a
    train step waits for an export under way (it would change the weights mid-export)."""

    def __init__(self) -> None:
        self.version = 0  # the version last published to the rollout workers
        self._ahead = False
        self._exporting = False
        self._changed: asyncio.Condition | None = None  # made on the loop the run uses

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def training(self) -> None:
        async with self._condition():
            await self._condition().wait_for(lambda: not self._exporting)
            self._ahead = True

    async def published(self, version: int) -> None:
        async with self._condition():
            self._ahead, self.version = False, version
            self._condition().notify_all()

    @asynccontextmanager
    async def exporting(self) -> AsyncIterator[int]:
        """Hold the trainer's weights at the published version; yields that version."""
        async with self._condition():
            await self._condition().wait_for(lambda: not self._ahead)
            self._exporting = True
        try:
            yield self.version
        finally:
            async with self._condition():
                self._exporting = False
                self._condition().notify_all()


class RolloutActors:
    """Rollout worker i is `handle(i)`: its first process is given, later ones (after a loss)
    come from `new_worker(i, incarnation)`. Calls go through `calls` (named, with a deadline).
    A replacement rejoins the weight channel with `reconnect()` (blocking: run off the loop)
    and takes the published weights with `send_weights(version)`, which returns the version
    each worker then hosts (-1: lost)."""

    def __init__(self, handles: list[Any], new_worker: Callable[[int, int], Any],
                 calls: RayCalls, weights: PublishedWeights, *,
                 reconnect: Callable[[], None],
                 send_weights: Callable[[int], Awaitable[list[int]]]) -> None:
        self.calls = calls
        self.weights = weights  # what a replacement may take, and when
        self._handles = list(handles)
        self._new_worker = new_worker
        self._incarnations = [0] * len(self._handles)
        self._lost: set[int] = set()  # workers being replaced: calls to them fail at once
        self._reconnect = reconnect
        self._send = send_weights

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def handles(self) -> list[Any]:
        """Each worker's current actor handle (a copy: the set alone replaces them)."""
        return list(self._handles)

    def handle(self, worker: int) -> Any:
        return self._handles[worker]

    def is_lost(self, worker: int) -> bool:
        """Being replaced (or found dead): its calls raise `WorkerLost` at once."""
        return worker in self._lost

    def live(self) -> list[int]:
        """The workers not lost, in order."""
        return [i for i in range(len(self._handles)) if i not in self._lost]

    def mark_lost(self, worker: int) -> None:
        """Found dead outside a call of its own (a weight send): its next call tells the
        rollout, which puts its requests back and has it replaced."""
        self._lost.add(worker)

    @property
    def replacements(self) -> int:
        """Processes started to replace lost rollout workers, in all."""
        return sum(self._incarnations)

    async def call(self, worker: int, what: str, call: Callable[[Any], Any]) -> Any:
        """`call(actor)` on a rollout worker, its process's death raised as `WorkerLost` (the
        rollout puts its requests back and has it replaced) rather than a run-ending error."""
        if worker in self._lost:
            raise WorkerLost(worker, what, "it is being replaced")
        try:
            return await self.calls.call(f"rollout worker {worker}", what,
                                         call(self._handles[worker]))
        except WorkerCallError as exc:
            if actor_died(exc) and not failed_to_start(exc):
                raise WorkerLost(worker, what, str(exc.__cause__).splitlines()[0]) from exc
            raise

    def results_of_each(self, refs: list[Any], kind: str, default: Any) -> list[Any]:
        """The results of one weight-channel call per rollout worker (in worker order),
        `default` for a worker that died: marked lost, unless the channel (`kind`) is a
        collective group, which cannot form without it (an error)."""
        import ray

        timeout_s = self.calls.timeout_s
        results = []
        for index, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=timeout_s))
            except ray.exceptions.RayActorError as exc:
                self.calls.raise_if_ray_lost(exc)
                if exc.actor_init_failed:  # it never started: no replacement would either
                    raise WorkerCallError(f"rollout worker {index} failed during start-up: "
                                          + self.calls.reason(f"rollout worker {index}",
                                                              "start-up", exc)) from exc
                if kind == "collective":
                    raise WorkerCallError(f"rollout worker {index} died while the weight "
                                          "channel's collective group formed") from None
                self._lost.add(index)
                results.append(default)
            except ray.exceptions.GetTimeoutError:
                raise WorkerCallError(f"rollout worker {index} did not finish the weight "
                                      f"channel's set-up within {timeout_s:.0f} s "
                                      "(cluster.timeout_s)") from None
            except ray.exceptions.RayError as exc:
                self.calls.raise_if_ray_lost(exc)
                raise WorkerCallError(f"rollout worker {index} failed during the weight "
                                      "channel's set-up: " + self.calls.reason(
                                          f"rollout worker {index}", "weight channel set-up",
                                          exc)) from exc
        return results

    async def replace_worker(self, worker: int) -> int:
        """A new process for a lost rollout worker: started, joined to the weight channel
        (a collective group is rebuilt for every member) and loaded with the published
        weights, sent to every worker again once the trainer's are published (a worker already
        on them stages the same version). Returns the version it hosts."""
        self._lost.add(worker)
        for attempt in range(1, REPLACEMENT_ATTEMPTS + 1):
            version = await self._start_replacement(worker, f"replacement {attempt} of "
                                                    f"{REPLACEMENT_ATTEMPTS}")
            if version is not None:
                return version
        raise WorkerCallError(f"rollout worker {worker}: {REPLACEMENT_ATTEMPTS} replacement "
                              "processes in a row died before taking work")

    async def _start_replacement(self, worker: int, which: str) -> int | None:
        """One new process for `worker`, up to its first weights: their version, or None when
        it died on the way (the caller tries another)."""
        import ray

        ray.kill(self._handles[worker], no_restart=True)  # if it still half-lives
        self._incarnations[worker] += 1
        self._handles[worker] = self._new_worker(worker, self._incarnations[worker])
        try:
            await self.calls.call(f"rollout worker {worker} ({which})", "start-up",
                                  self._handles[worker].stats.remote())
        except WorkerCallError as exc:
            if actor_died(exc) and not failed_to_start(exc):  # died: another may live
                return None
            raise
        async with self.weights.exporting() as version:
            self._lost.discard(worker)
            await asyncio.to_thread(self._reconnect)
            if worker in self._lost:
                return None  # died joining the channel
            hosted = await self._send(version)
        return hosted[worker] if hosted[worker] >= 0 else None

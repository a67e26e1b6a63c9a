"""Rollout workers lost and replaced, on Ray: a dead worker's calls become `WorkerLost` for the
rollout (which puts its requests back), and `replace_worker` starts a new process under the
same index, rebuilds the weight channel and gives it the published weights. A mixin of
`RayRuntime`, which owns the actors, the channel and `_send_weights`."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from ..errors import WorkerCallError, WorkerLost

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


class WorkerReplacement:
    workers: list[Any]
    colocated: bool
    timeout_s: float
    weights: PublishedWeights
    _lost: set[int]
    _incarnations: list[int]
    _new_worker: Callable[[int, int], Any]
    _call: Callable[..., Any]  # RayRuntime's named call with a deadline
    _reason: Callable[[str, str, BaseException], str]  # a failure's cause, in one line
    _raise_if_ray_lost: Callable[..., None]  # RayLost when the GCS or raylet is gone
    _send_weights: Callable[..., Any]
    _connect_weight_channel: Callable[[], None]

    async def _rollout_call(self, worker: int, what: str, call: Callable[[Any], Any]) -> Any:
        """`call(actor)` on a rollout worker, its process's death raised as `WorkerLost` (the
        rollout puts its requests back and has it replaced) rather than a run-ending error."""
        if worker in self._lost:
            raise WorkerLost(worker, what, "it is being replaced")
        try:
            return await self._call(f"rollout worker {worker}", what,
                                    call(self.workers[worker]))
        except WorkerCallError as exc:
            if actor_died(exc) and not failed_to_start(exc):
                raise WorkerLost(worker, what, str(exc.__cause__).splitlines()[0]) from exc
            raise

    def _each_worker(self, refs: list[Any], kind: str, default: Any) -> list[Any]:
        """The results of one call per rollout worker (in worker order), `default` for a worker
        that died: marked lost, unless the channel is a collective group, which cannot form
        without it (an error)."""
        import ray

        results = []
        for index, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=self.timeout_s))
            except ray.exceptions.RayActorError as exc:
                self._raise_if_ray_lost(exc)
                if exc.actor_init_failed:  # it never started: no replacement would either
                    raise WorkerCallError(f"rollout worker {index} failed during start-up: "
                                          + self._reason(f"rollout worker {index}", "start-up",
                                                         exc)) from exc
                if kind == "collective":
                    raise WorkerCallError(f"rollout worker {index} died while the weight "
                                          "channel's collective group formed") from None
                self._lost.add(index)
                results.append(default)
            except ray.exceptions.GetTimeoutError:
                raise WorkerCallError(f"rollout worker {index} did not finish the weight "
                                      f"channel's set-up within {self.timeout_s:.0f} s "
                                      "(cluster.timeout_s)") from None
            except ray.exceptions.RayError as exc:
                self._raise_if_ray_lost(exc)
                raise WorkerCallError(f"rollout worker {index} failed during the weight "
                                      "channel's set-up: " + self._reason(
                                          f"rollout worker {index}", "weight channel set-up",
                                          exc)) from exc
        return results

    async def replace_worker(self, worker: int) -> int:
        """A new process for a lost rollout worker: started, joined to the weight channel
        (a collective group is rebuilt for every member) and loaded with the published
        weights, sent to every worker again once the trainer's are published (a worker already
        on them stages the same version). Returns the version it hosts."""
        if self.colocated:
            raise WorkerLost(worker, "generation", "a colocated rollout worker shares its "
                             "device with a trainer rank and is not replaced; resume the run "
                             "from its last checkpoint (resume=auto)")
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

        ray.kill(self.workers[worker], no_restart=True)  # if it still half-lives
        self._incarnations[worker] += 1
        self.workers[worker] = self._new_worker(worker, self._incarnations[worker])
        try:
            await self._call(f"rollout worker {worker} ({which})", "start-up",
                             self.workers[worker].stats.remote())
        except WorkerCallError as exc:
            if actor_died(exc) and not failed_to_start(exc):  # died: another may live
                return None
            raise
        async with self.weights.exporting() as version:
            self._lost.discard(worker)
            await asyncio.to_thread(self._connect_weight_channel)
            if worker in self._lost:
                return None  # died joining the channel
            hosted = await self._send_weights(version)
        return hosted[worker] if hosted[worker] >= 0 else None

    @property
    def replacements(self) -> int:
        """Processes started to replace lost rollout workers, in all."""
        return sum(self._incarnations)


"""A real run's trace: `TracingRuntime` wraps any runtime the controller drives and records
what each worker is doing, from the calls the controller makes, without the controller or the
workers knowing. `TimedReward` adds the driver's reward scoring.

A worker can be in several calls at once (a generate stream runs while an abort or a weight
load reaches it; the rollout opens one stream per batch of requests). The trace shows one
activity per worker at a time, so that its spans never overlap and the gaps are exactly its
idle time: the most significant activity under way (`PRIORITY`) is the one drawn.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Sequence

from ..core.rewarding import SafeReward, Scored
from ..protocol import EngineStats, GenerationRequest, GenerationResult
from ..runtime_protocol import (Checkpointable, Elastic, Plannable, Recoverable,
                                TrainerRankLost, TrainerRecoverable, capabilities)
from .trace import Trace

# Most significant first: a worker loading weights while its stream is open is drawn as
# loading weights (the stream waits for it), an abort during generation as a migration.
PRIORITY = ("replace", "join", "leave", "weight sync", "checkpoint", "configure", "migrate",
            "replica", "train", "reward", "evaluate", "generate")
# Spans of one kind closer than this are drawn as one, with the calls counted and the time
# really spent in them kept (`busy_s`): reward calls come in bursts of thousands per step, and
# one event per call would make a long run's trace too large to open.
MERGE_GAP_S = {"reward": 0.01}
MERGE_GAP_DEFAULT_S = 1e-3

Key = tuple[str, int]  # (role, worker index)


class Track:
    """One worker's activities: how many calls of each kind are under way, and the span being
    drawn (the top kind since when), written to the trace when the top kind changes."""

    def __init__(self, trace: Trace, role: str, index: int) -> None:
        self.trace, self.role, self.index = trace, role, index
        self.active: dict[str, int] = {}
        self.current: tuple[str, float] | None = None
        self.last: dict[str, Any] | None = None  # the last event written, to lengthen

    def begin(self, kind: str, now: float) -> None:
        self.active[kind] = self.active.get(kind, 0) + 1
        self._redraw(now)

    def end(self, kind: str, now: float) -> None:
        if kind not in self.active:  # a stream closed after the run's end (`close`)
            return
        self.active[kind] -= 1
        if not self.active[kind]:
            del self.active[kind]
        self._redraw(now)

    def close(self, now: float) -> None:
        """The run's end: whatever is still under way ends now."""
        self.active.clear()
        self._redraw(now)

    def _redraw(self, now: float) -> None:
        top = next((kind for kind in PRIORITY if kind in self.active), None)
        if self.current is not None and self.current[0] == top:
            return
        if self.current is not None:
            self._emit(*self.current, now)
        self.current = (top, now) if top is not None else None

    def _emit(self, kind: str, start: float, end: float) -> None:
        last = self.last
        gap = MERGE_GAP_S.get(kind, MERGE_GAP_DEFAULT_S)
        if last is not None and last["name"] == kind and \
                start * 1e6 - (last["ts"] + last["dur"]) < gap * 1e6:
            last["dur"] = end * 1e6 - last["ts"]
            last["args"]["calls"] += 1
            last["args"]["busy_s"] += end - start
            return
        self.last = self.trace.span(self.role, self.index, kind, start, end - start,
                                    {"calls": 1, "busy_s": end - start})


class TracingRuntime:
    """The runtime protocol (`runtime_protocol.Runtime`), passed through to `runtime`, with each
    worker's activity recorded in `trace` (seconds since `origin`, on the runtime's clock).

    Every call is forwarded explicitly, and the wrapper has exactly the capabilities of the
    runtime it wraps: `TracingRuntime(runtime, ...)` is an instance of a subclass that adds the
    traced forwarding of each optional protocol `runtime` implements (`_FORWARDERS`), so
    `isinstance(tracer, Recoverable)` answers as `isinstance(runtime, Recoverable)` does."""

    def __new__(cls, runtime: Any, *args: Any, **kwargs: Any) -> "TracingRuntime":
        if cls is TracingRuntime:
            cls = _traced_class(tuple(capabilities(runtime)))
        return super().__new__(cls)

    def __init__(self, runtime: Any, trace: Trace, trainer_ranks: int = 1,
                 origin: float | None = None) -> None:
        self.runtime = runtime
        self.trace = trace
        self.origin = runtime.now() if origin is None else origin
        self.tracks: dict[Key, Track] = {}
        for rank in range(trainer_ranks):
            self._track(("train", rank), f"trainer rank {rank}")
        for worker in range(len(runtime.workers)):
            self._track(("rollout", worker), f"rollout worker {worker}")
        self._track(("driver", 0), "reward scoring (driver)")

    def _track(self, key: Key, name: str) -> Track:
        self.trace.name_thread(*key, name)
        track = self.tracks[key] = Track(self.trace, *key)
        return track

    @property
    def workers(self) -> list[Any]:
        return self.runtime.workers

    def now(self) -> float:
        return self.runtime.now()

    # -- spans -----------------------------------------------------------------------------

    def _at(self) -> float:
        return self.runtime.now() - self.origin

    def _mark(self, kind: str, keys: list[Key], begin: bool) -> None:
        now = self._at()
        for key in keys:
            track = self.tracks.get(key) or self._track(key, f"rollout worker {key[1]}")
            (track.begin if begin else track.end)(kind, now)

    async def _timed(self, kind: str, keys: list[Key], call) -> Any:
        self._mark(kind, keys, True)
        try:
            return await call
        finally:
            self._mark(kind, keys, False)

    def _role(self, role: str) -> list[Key]:
        return [key for key in self.tracks if key[0] == role]

    # -- the runtime protocol ----------------------------------------------------------------

    async def generate(self, worker: int, requests: list[GenerationRequest]
                       ) -> AsyncIterator[GenerationResult]:
        """One span from the call to the end of its stream (per request would be too many):
        "evaluate" for held-out evaluation requests, else "generate"."""
        keys = [("rollout", worker)]
        # one purpose per call: the rollout's streams send evaluation and training apart
        evaluation = bool(requests) and getattr(requests[0], "purpose", "train") == "eval"
        kind = "evaluate" if evaluation else "generate"
        self._mark(kind, keys, True)
        try:
            async for result in self.runtime.generate(worker, requests):
                yield result
        finally:
            self._mark(kind, keys, False)

    async def train(self, batch: Any, replicas: Sequence[int] = ()) -> dict[str, float]:
        """The trainer ranks train; rollout workers lent to training (elastic replicas) too."""
        lent = [("rollout", w) for w in replicas]
        return await self._timed("train", self._role("train"), self._timed(
            "replica", lent, self.runtime.train(batch, replicas)))

    async def sync_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        return await self._timed("weight sync", self._role("train") + self._role("rollout"),
                                 self.runtime.sync_weights(version, hold))

    async def abort(self, worker: int, request_ids: list[str]) -> None:
        await self._timed("migrate", [("rollout", worker)],
                          self.runtime.abort(worker, request_ids))

    async def worker_stats(self) -> list[EngineStats]:
        return await self.runtime.worker_stats()

    # -- the driver and the end ----------------------------------------------------------------

    def timed_reward(self, reward: SafeReward) -> "TimedReward":
        """`reward` as it is, its calls drawn on the driver's track."""
        settings = {f.name: getattr(reward, f.name) for f in fields(reward) if f.init}
        return TimedReward(**settings, tracer=self)

    def close(self) -> Trace:
        """End every span still open (the run is over) and give the finished trace."""
        now = self._at()
        for track in self.tracks.values():
            track.close(now)
        self.trace.duration_s = now
        return self.trace


class _TracedElastic:
    async def join_training(self, worker: int) -> None:
        await self._timed("join", [("rollout", worker)], self.runtime.join_training(worker))

    async def replica_version(self, worker: int) -> int:
        return await self.runtime.replica_version(worker)

    async def leave_training(self, worker: int) -> int:
        return await self._timed("leave", [("rollout", worker)],
                                 self.runtime.leave_training(worker))


class _TracedPlannable:
    async def configure_rollout(self, max_batch_size: int, partial_rollout: bool) -> list[int]:
        return await self._timed("configure", self._role("rollout"),
                                 self.runtime.configure_rollout(max_batch_size, partial_rollout))


class _TracedRecoverable:
    async def replace_worker(self, worker: int) -> int:
        return await self._timed("replace", [("rollout", worker)],
                                 self.runtime.replace_worker(worker))

    @property
    def replacements(self) -> int:
        return self.runtime.replacements


class _TracedCheckpointable:
    async def save(self, path: str) -> None:
        await self._timed("checkpoint", self._role("train"), self.runtime.save(path))

    async def load(self, path: str) -> None:
        await self._timed("checkpoint", self._role("train"), self.runtime.load(path))


class _TracedTrainerRecoverable:
    async def recover_trainer(self, lost: TrainerRankLost) -> dict[str, float]:
        return await self._timed("replace", self._role("train"),
                                 self.runtime.recover_trainer(lost))


_FORWARDERS = {Elastic: _TracedElastic, Plannable: _TracedPlannable,
               Recoverable: _TracedRecoverable, Checkpointable: _TracedCheckpointable,
               TrainerRecoverable: _TracedTrainerRecoverable}


@functools.cache
def _traced_class(caps: tuple[type, ...]) -> type:
    if not caps:
        return TracingRuntime
    name = "Tracing" + "".join(cap.__name__ for cap in caps) + "Runtime"
    return type(name, (*(_FORWARDERS[cap] for cap in caps), TracingRuntime), {})


@dataclass
class TimedReward(SafeReward):
    """A `SafeReward` whose calls are drawn as "reward" on the driver's track: the reward runs
    in the controller's process, between the results it scores."""

    tracer: Any = field(default=None, repr=False)

    def __call__(self, response: str, answer: str) -> tuple[float, str | None]:
        self.tracer._mark("reward", [("driver", 0)], True)
        try:
            return SafeReward.__call__(self, response, answer)
        finally:
            self.tracer._mark("reward", [("driver", 0)], False)

    async def score_parts(self, response: str, answer: str) -> Scored:
        """As the rollout scores: in the reward pool, drawn from the call to its answer."""
        self.tracer._mark("reward", [("driver", 0)], True)
        try:
            return await SafeReward.score_parts(self, response, answer)
        finally:
            self.tracer._mark("reward", [("driver", 0)], False)


def flush_at_checkpoints(checkpoint, every: int, trace: Trace, path: str):
    """The controller's between-steps hook `checkpoint`, followed by a write of the trace so
    far whenever it saved a checkpoint (`checkpoint.every`): a crash keeps the trace up to
    there. Not every step: each write is the whole trace."""
    async def checkpoint_and_flush(step: int) -> None:
        await checkpoint(step)
        if every and step % every == 0:
            trace.write(path)
    return checkpoint_and_flush

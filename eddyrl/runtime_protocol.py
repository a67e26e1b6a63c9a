"""What the controller and the rollout ask of a runtime, complete and typed.

`Runtime` is what every runtime does: generate on rollout workers, abort, train, publish
weights, report worker stats, tell the time. The rest are capabilities a runtime has or has
not, each its own `Protocol`; the controller asks `isinstance(runtime, Elastic)`-style questions
once, when it is built (`eddyrl.build`), and a setting that needs a capability the runtime
lacks is refused there by name:

- `Elastic`: lend a rollout worker to training as a gradient replica and take it back
  (Libra's elastic pool);
- `Recoverable`: start a new process for a rollout worker whose calls raised
  `errors.WorkerLost` (without it a lost worker ends the run);
- `Checkpointable`: save and load the trainer's state (a run checkpoint's model and optimizer);
- `Plannable`: change every rollout worker's generation strategy while running (the adaptive
  scheduler's plans);
- `TrainerRecoverable`: rebuild the trainer in place after `TrainerRankLost` (a replacement
  rank, or the survivors alone), at the state of the last completed call, so that the call
  that lost it can run again (`core/trainer_recovery.py`).

The implementations: `runtime.ray.RayRuntime` (all four), `sim.runtime.SimRuntime` (elastic,
plannable), `runtime.inprocess.InProcessRuntime` (none: evaluation and tests) and
`observability.tracing.traced(runtime)`, which has exactly the capabilities of the runtime it
wraps. `conforms` checks a class against a protocol by its signatures (tests/fast/structure).

A runtime that loses a trainer rank raises `TrainerRankLost` (defined here, beside the seam
it crosses, so that recovery in `core/` catches it without importing a runtime).

It sits beside `protocol.py`, not in `runtime/`, and imports only that module and `errors.py`
(the error a lost rank is), so `core/` can type its seams with it without importing a runtime.
"""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Protocol, Sequence, runtime_checkable

from .errors import WorkerCallError
from .protocol import EngineStats, GenerationRequest, GenerationResult

ACTOR_DIED = "actor died"
COLLECTIVE_TIMED_OUT = "collective timed out"


class TrainerRankLost(WorkerCallError):
    """A trainer rank is gone: its process died (`ACTOR_DIED`: killed, crashed, its node
    lost), or it stopped taking part in the trainer's collectives (`COLLECTIVE_TIMED_OUT`:
    the others waited `train.collective_timeout_s` for it). A `TrainerRecoverable` runtime
    rebuilds the trainer without it; where it cannot (`not_recovered`: why) the run ends on it
    (`eddy train` adds how to resume). Its fields are what recovery needs: which rank, where
    it ran, why."""

    def __init__(self, rank: int, during: str, cause: str, detail: str = "", *,
                 node: str | None = None, node_id: str | None = None,
                 pid: int | None = None, why_not: str = "") -> None:
        self.rank, self.during, self.cause, self.detail = rank, during, cause, detail
        self.node, self.node_id, self.pid, self.why_not = node, node_id, pid, why_not
        where = [f"node {node or 'unknown'}"]
        if node_id:
            where.append(f"node id {node_id[:12]}")  # as `ray list nodes` begins it
        if pid is not None:
            where.append(f"pid {pid}")
        super().__init__(f"trainer rank {rank} ({', '.join(where)}) was lost during {during}: "
                         f"{cause}" + (f" ({detail})" if detail else "")
                         + "; the run cannot go on without it"
                         + (f" ({why_not})" if why_not else ""))

    def not_recovered(self, why: str) -> "TrainerRankLost":
        """The same loss, ending the run: `why` it was not recovered in place."""
        return TrainerRankLost(self.rank, self.during, self.cause, self.detail, node=self.node,
                               node_id=self.node_id, pid=self.pid, why_not=why)


@runtime_checkable
class Runtime(Protocol):
    # One entry per rollout worker (an actor handle, an engine); only its length is read
    workers: list[Any]

    def now(self) -> float:
        """Seconds on the runtime's clock (wall time, or the simulator's virtual time)."""
        ...

    def generate(self, worker: int, requests: list[GenerationRequest]
                 ) -> AsyncIterator[GenerationResult]:
        """Stream `worker`'s results for `requests` (the engine contract's `generate`)."""
        ...

    async def abort(self, worker: int, request_ids: list[str]) -> None:
        ...

    async def train(self, batch: Any, replicas: Sequence[int] = ()) -> dict[str, float]:
        """One training step on `batch` (what the controller's batch builder made); rollout
        workers in `replicas` (lent to training, `Elastic`) train as gradient replicas too."""
        ...

    async def sync_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        """Publish `version` to every rollout worker; returns the version each one now hosts
        (a busy worker, or one in `hold`, keeps its version, with the new one staged)."""
        ...

    async def worker_stats(self) -> list[EngineStats]:
        """Each rollout worker's `EngineStats` (KV-cache use, queues)."""
        ...


@runtime_checkable
class Elastic(Protocol):
    async def join_training(self, worker: int) -> None:
        """Rollout worker `worker` stops generating (its engine sleeps) and becomes a
        gradient replica of the trainer."""
        ...

    async def replica_version(self, worker: int) -> int:
        """The policy version a lent worker's replica holds."""
        ...

    async def leave_training(self, worker: int) -> int:
        """The lent worker goes back to generating; returns the version it then hosts."""
        ...


@runtime_checkable
class Recoverable(Protocol):
    async def replace_worker(self, worker: int) -> int:
        """Start a new process for a lost rollout worker, load the last published weights
        into it and return their version."""
        ...

    @property
    def replacements(self) -> int:
        """Rollout workers replaced so far."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    async def save(self, path: str) -> None:
        """Write the trainer's state (model, optimizer) under `path`."""
        ...

    async def load(self, path: str) -> None:
        ...


@runtime_checkable
class Plannable(Protocol):
    async def configure_rollout(self, max_batch_size: int, partial_rollout: bool) -> list[int]:
        """Every rollout worker decodes up to `max_batch_size` sequences together, new weights
        reaching running ones or not; returns the version each worker hosts."""
        ...


@runtime_checkable
class TrainerRecoverable(Protocol):
    async def recover_trainer(self, lost: TrainerRankLost) -> dict[str, float]:
        """Rebuild the trainer without `lost`'s rank, at the state of its last completed call
        (weights, optimizer, generators), so that the interrupted call can run again; returns
        the recovery's metrics. Raises `lost.not_recovered(why)` where it cannot."""
        ...


# A runtime together with one capability: what a driver that needs it holds (`eddyrl.build`
# hands one over only after its isinstance check). Types only, never checked against.
class ElasticRuntime(Runtime, Elastic, Protocol):
    ...


class PlannableRuntime(Runtime, Plannable, Protocol):
    ...


CAPABILITIES: tuple[type, ...] = (Elastic, Recoverable, Checkpointable, Plannable,
                                  TrainerRecoverable)


def capabilities(runtime: Any) -> list[type]:
    """The optional protocols `runtime` implements."""
    return [cap for cap in CAPABILITIES if isinstance(runtime, cap)]


def conforms(cls: type, protocol: type) -> list[str]:
    """How `cls` departs from `protocol`: each member missing, async where the protocol is
    not (or the reverse), or taking other parameters. Empty: it conforms. `isinstance` on a
    runtime-checkable protocol only checks that the names exist; this checks signatures."""
    problems = []
    for name, want in _members(protocol).items():
        have = inspect.getattr_static(cls, name, None)
        if have is None:  # a data member: declared on the class (set in __init__)
            if not any(name in getattr(klass, "__annotations__", {}) for klass in cls.__mro__):
                problems.append(f"{cls.__name__}.{name} is missing")
            continue
        if not callable(want):
            continue
        if isinstance(want, property):
            if not isinstance(have, property):
                problems.append(f"{cls.__name__}.{name} is not a property")
            continue
        function = have.__func__ if isinstance(have, (staticmethod, classmethod)) else have
        if not callable(function):
            problems.append(f"{cls.__name__}.{name} is not a method")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(function):
            # a plain method returning an async iterator (the protocol's `generate`) may be
            # an async generator; a coroutine must stay one
            problems.append(f"{cls.__name__}.{name} is {_kind(function)}, the protocol's is "
                            f"{_kind(want)}")
        want_params, have_params = _params(want), _params(function)
        if want_params != have_params[:len(want_params)] or any(
                p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                          p.VAR_KEYWORD)
                for p in inspect.signature(function).parameters.values()
                if p.name in have_params[len(want_params):]):
            problems.append(f"{cls.__name__}.{name}{inspect.signature(function)} differs "
                            f"from the protocol's {name}{inspect.signature(want)}")
    return problems


def _members(protocol: type) -> dict[str, Any]:
    members = {name: value for name, value in vars(protocol).items()
               if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    for name in getattr(protocol, "__annotations__", {}):
        members.setdefault(name, None)
    return members


def _kind(function: Any) -> str:
    return "a coroutine" if inspect.iscoroutinefunction(function) else "not a coroutine"


def _params(function: Any) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

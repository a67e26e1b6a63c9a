"""The request table: one record per generation request, with one status, one worker and one
version, changed only by this module's transitions (nano-vllm's `Sequence` + `SequenceStatus`).

Every question the rollout, the version assignment and the bucket router ask about where work
is — how many requests of version v a worker has, how many of them are between turns, how many
connections an instance holds, which requests run on a worker, which wait for any worker — is
answered from this table. The per-worker counts are kept by the table alone, in `_account`,
which every transition goes through; `check()` recomputes them from the records (the
randomized schedule test calls it after every event).

A request is in exactly one status:

- RUNNING: sent to `worker`'s engine (queued or generating there), or about to be (a resume
  batched for this moment). Counted on `worker`.
- MOVING: aborted on `source` for a move to `worker` (DORA's consolidation, a router move, a
  lent worker's evacuation); its engine on `source` still runs it until the abort lands, then
  it resumes on `worker` from its partial output. Counted on `worker`, the target: the book has
  it there from the moment the move is decided, so that no other move or placement counts the
  same slot twice.
- BETWEEN_TURNS: a multi-turn episode whose environment is stepping. Counted on `worker` (its
  next turn comes back there, DORA keeps its version alive for it), but no engine runs it.
- PARKED: no worker can run it (every worker lost); it waits for a replacement. Counted nowhere.
- SCORING: its final result is in and its reward is being computed. Counted nowhere (its
  worker's slot is free).

Finished requests leave the table; their ids are remembered (`is_done`) until their group is
forgotten, so that a duplicate final result is recognised as one. Illegal transitions raise at
once with the request's recent history. Who may run a version where (C1) is the version
assignment's rule: the table asks its `book` (`check_place`) before a request enters a worker,
and tells it (`worker_changed`) after the work on a worker changed, so that the book's hosted
versions follow the engines' (a worker switches to the latest weights when its legacy work
drains). Transition counts (`events`, "transition:why") are the rollout's counters: moves,
restarts by reason; `counted(transition)` sums one transition's. The rollout creates the table
(with the assignment as its book) and hands it to the assignment, placement, moves and turns.

A request's `purpose` says where its result goes: TRAIN (a dispatched group: the store, the
version window, the ledger), REFILL (a synchronous refill: the ledger only) or EVAL (held-out
evaluation: none of them).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..protocol import Group, SamplingParams

if TYPE_CHECKING:  # annotations only: episodes.py brings in the environments
    from .episodes import EpisodeRun

HISTORY = 12  # transitions kept per request, for the error an illegal one raises


class Purpose(enum.Enum):
    """Why a request is generated, which says where its result goes."""

    TRAIN = "train"  # a dispatched group: into the store and version window, and the ledger
    REFILL = "refill"  # a synchronous refill (`generate_now`): the ledger only, then trained
    EVAL = "eval"  # held-out evaluation: none of them, never trained

    @property
    def stored(self) -> bool:
        """Its result goes into the experience store and its group through the window."""
        return self is Purpose.TRAIN

    @property
    def in_ledger(self) -> bool:
        """Its group is in the ledger (training data of either kind)."""
        return self is not Purpose.EVAL


class Status(enum.Enum):
    RUNNING = "running"
    MOVING = "moving"
    BETWEEN_TURNS = "between_turns"
    PARKED = "parked"
    SCORING = "scoring"


# statuses whose request is counted on its `worker`
COUNTED = frozenset({Status.RUNNING, Status.MOVING, Status.BETWEEN_TURNS})

# (from, to) pairs a transition may make; None: not in the table (added, or finished)
LEGAL = {
    (None, Status.RUNNING), (None, Status.PARKED),
    (Status.RUNNING, Status.MOVING),  # an abort for a move is on its way
    (Status.MOVING, Status.RUNNING),  # the source's run ended: it is on its target now
    (Status.RUNNING, Status.RUNNING),  # redirected before its engine saw it
    (Status.RUNNING, Status.BETWEEN_TURNS), (Status.BETWEEN_TURNS, Status.RUNNING),
    (Status.BETWEEN_TURNS, Status.BETWEEN_TURNS),  # its next turn will go to another worker
    (Status.RUNNING, Status.PARKED), (Status.BETWEEN_TURNS, Status.PARKED),
    (Status.PARKED, Status.RUNNING), (Status.BETWEEN_TURNS, Status.SCORING),
    (Status.RUNNING, Status.SCORING), (Status.SCORING, None),
}


class IllegalTransition(RuntimeError):
    """A caller asked the table for a transition its status does not allow."""


class Book(Protocol):
    """The version assignment's side of the table (`VersionAssignment` implements it)."""

    def check_place(self, worker: int, version: int, how: str) -> None:
        """Raise ValueError if a request of `version` may not enter `worker` now (C1)."""

    def worker_changed(self, worker: int) -> None:
        """The work counted on `worker` changed."""


class _AnyPlace:
    """A book that allows every placement (the table's own tests)."""

    def check_place(self, worker: int, version: int, how: str) -> None:
        return None

    def worker_changed(self, worker: int) -> None:
        return None


@dataclass(slots=True, eq=False)
class Request:
    """One generation request. `status`, `worker`, `version` and `source` change only through
    `RequestTable`; the rest is the request's own data."""

    id: str
    group: Group
    sample: int
    sampling: SamplingParams
    purpose: Purpose
    priority: int  # the group's dispatch order: engines run older groups first
    episode: EpisodeRun | None = None  # multi-turn: its transcript and environment
    status: Status | None = None
    worker: int | None = None
    version: int = 0
    source: int | None = None  # MOVING: the worker still running it until its abort lands
    # workers where an abort for it arrived after its turn had ended there: the engine keeps
    # it and aborts the request's next turn on that worker (only an episode comes back)
    stale_aborts: set[int] = field(default_factory=set)
    # it carries generated tokens (resumed from a partial output or a transcript): its version
    # is fixed (C1); a fresh one may still start on newer weights (`relabel`)
    resumed: bool = False
    history: list[str] = field(default_factory=list)

    def runs_on(self, worker: int) -> bool:
        """Whether `worker`'s engine runs this request now: results from it are current."""
        return (self.status is Status.RUNNING and self.worker == worker) or \
            (self.status is Status.MOVING and self.source == worker)


class RequestTable:
    def __init__(self, num_workers: int, book: Book | None = None) -> None:
        self.num_workers = num_workers
        self.book: Book = book if book is not None else _AnyPlace()
        self._records: dict[str, Request] = {}
        self._done: set[str] = set()
        # per worker: requests counted there by version, and of those the ones between turns
        self.pending: list[Counter[int]] = [Counter() for _ in range(num_workers)]
        self.between_turns: list[Counter[int]] = [Counter() for _ in range(num_workers)]
        self.events: Counter[str] = Counter()

    # -- queries ---------------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._records.values()))

    def counted(self, transition: str, *, but: tuple[str, ...] = ()) -> int:
        """Transitions of one kind made so far (all reasons, less those in `but`)."""
        return sum(n for key, n in self.events.items()
                   if key.split(":", 1)[0] == transition and key.split(":", 1)[1] not in but)

    def get(self, request_id: str) -> Request | None:
        return self._records.get(request_id)

    def __getitem__(self, request_id: str) -> Request:
        return self._records[request_id]

    def is_done(self, request_id: str) -> bool:
        return request_id in self._done

    def load(self, worker: int) -> int:
        """Requests counted on `worker` (a router's connections)."""
        return sum(self.pending[worker].values())

    def worker_of(self, request_id: str) -> int:
        worker = self._records[request_id].worker
        if worker is None:
            raise KeyError(f"request {request_id} is on no worker "
                           f"({self._records[request_id].status.value})")
        return worker

    def counted_on(self, worker: int) -> list[Request]:
        return [r for r in self._records.values()
                if r.status in COUNTED and r.worker == worker]

    def with_status(self, status: Status) -> list[Request]:
        return [r for r in self._records.values() if r.status is status]

    # -- transitions -----------------------------------------------------------------------

    def add(self, request: Request, worker: int | None, version: int) -> Request:
        """A new request, RUNNING on `worker` (PARKED when None)."""
        known = self._records.get(request.id)
        if known is not None or request.id in self._done:
            raise IllegalTransition(self._describe(known or request, "add: already added"))
        status = Status.PARKED if worker is None else Status.RUNNING
        self._go(request, status, worker, version, None, "add", "new")  # checked first
        self._records[request.id] = request
        return request

    def move(self, request_id: str, target: int, why: str) -> None:
        """RUNNING -> MOVING: its abort is on the way to its worker; counted on `target`."""
        request = self._records[request_id]
        self._go(request, Status.MOVING, target, request.version, request.worker, "move", why,
                 how="move")

    def arrive(self, request_id: str, resumed: bool) -> None:
        """MOVING -> RUNNING on its target: the source's run ended (`resumed`: aborted, it
        resumes there; else it finished, was refused, or its source was lost)."""
        request = self._records[request_id]
        self._require(request, Status.MOVING, "arrive")
        self._go(request, Status.RUNNING, request.worker, request.version, None, "arrive",
                 "resumed" if resumed else "settled")

    def redirect(self, request_id: str, target: int, why: str) -> None:
        """RUNNING -> RUNNING on `target`, before any engine runs it (its move's target was
        lost before it resumed there)."""
        request = self._records[request_id]
        self._require(request, Status.RUNNING, "redirect")
        self._go(request, Status.RUNNING, target, request.version, None, "redirect", why,
                 how="move")

    def restart(self, request_id: str, why: str) -> None:
        """Off its worker, to start from scratch (`place`): its version's weights are gone,
        or its worker was lost. PARKED until placed."""
        request = self._records[request_id]
        if request.status is Status.MOVING:
            raise IllegalTransition(self._describe(request, "restart a moving request: settle "
                                                            "its move first (arrive)"))
        self._go(request, Status.PARKED, None, request.version, None, "restart", why)
        request.resumed = False  # from scratch

    def place(self, request_id: str, worker: int, version: int) -> None:
        """PARKED -> RUNNING on `worker` at `version`, from scratch."""
        request = self._records[request_id]
        self._require(request, Status.PARKED, "place")
        self._go(request, Status.RUNNING, worker, version, None, "place", "parked")

    def pause(self, request_id: str) -> None:
        """RUNNING -> BETWEEN_TURNS: its turn ended, its environment steps."""
        request = self._records[request_id]
        self._require(request, Status.RUNNING, "pause")
        self._go(request, Status.BETWEEN_TURNS, request.worker, request.version, None,
                 "pause", "turn_ended")

    def move_between_turns(self, request_id: str, target: int, why: str) -> None:
        """BETWEEN_TURNS on another worker: its next turn goes to `target` (no abort)."""
        request = self._records[request_id]
        self._require(request, Status.BETWEEN_TURNS, "move between turns")
        self._go(request, Status.BETWEEN_TURNS, target, request.version, None,
                 "move_between_turns", why, how="move")

    def resume(self, request_id: str, worker: int) -> None:
        """BETWEEN_TURNS -> RUNNING on `worker`: its next turn goes to the engine."""
        request = self._records[request_id]
        self._require(request, Status.BETWEEN_TURNS, "resume")
        how = "stay" if worker == request.worker else "move"
        self._go(request, Status.RUNNING, worker, request.version, None, "resume",
                 "stayed" if how == "stay" else "moved", how=how)

    def relabel(self, request_id: str, version: int) -> None:
        """Same status and worker, newer version: a request queued for an older staged version
        starts on the newest (the engine applies the newest staged weights), or partial
        rollout goes on with the latest."""
        request = self._records[request_id]
        if request.status not in COUNTED:
            raise IllegalTransition(self._describe(request, "relabel"))
        self._account(request, -1)
        request.version = version
        self._account(request, +1)
        request.history = (request.history + [f"relabel v{version}"])[-HISTORY:]
        self.book.worker_changed(request.worker)

    def score(self, request_id: str) -> None:
        """RUNNING (or BETWEEN_TURNS: its episode ended) -> SCORING: off its worker."""
        request = self._records[request_id]
        self._go(request, Status.SCORING, None, request.version, None, "score", "final")

    def finish(self, request_id: str) -> Request:
        """SCORING -> done: out of the table."""
        request = self._records[request_id]
        self._check_legal(request, None, "finish")
        del self._records[request_id]
        self._done.add(request_id)
        request.status = None
        self.events["finish:scored"] += 1
        return request

    def forget(self, request_ids: list[str]) -> None:
        """Their group was handed out: stop remembering the finished ids."""
        self._done.difference_update(request_ids)

    # -- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        """Recompute every count from the records; raise AssertionError on a difference."""
        pending = [Counter() for _ in range(self.num_workers)]
        between = [Counter() for _ in range(self.num_workers)]
        for request in self._records.values():
            assert request.status is not None, request.id
            if request.status in COUNTED:
                assert request.worker is not None, self._describe(request, "check")
                pending[request.worker][request.version] += 1
                if request.status is Status.BETWEEN_TURNS:
                    between[request.worker][request.version] += 1
            else:
                assert request.worker is None, self._describe(request, "check")
            assert (request.status is Status.MOVING) == (request.source is not None), \
                self._describe(request, "check")
            assert request.id not in self._done, request.id
        for worker in range(self.num_workers):
            assert +self.pending[worker] == pending[worker], \
                (worker, dict(self.pending[worker]), dict(pending[worker]))
            assert +self.between_turns[worker] == between[worker], \
                (worker, dict(self.between_turns[worker]), dict(between[worker]))

    # -- the one place a record changes ----------------------------------------------------

    def _go(self, request: Request, status: Status, worker: int | None, version: int,
            source: int | None, transition: str, why: str, how: str = "place") -> None:
        self._check_legal(request, status, transition)
        if status in COUNTED and (worker != request.worker or version != request.version
                                  or request.status not in COUNTED):
            self.book.check_place(worker, version, how)
        before = request.worker if request.status in COUNTED else None
        self._account(request, -1)
        request.status, request.worker, request.version, request.source = \
            status, worker, version, source
        self._account(request, +1)
        request.history = (request.history + [f"{transition}({why}) -> {status.value}"
                                              f"@{worker} v{version}"])[-HISTORY:]
        self.events[f"{transition}:{why}"] += 1
        for changed in {before, worker if status in COUNTED else None} - {None}:
            self.book.worker_changed(changed)

    def _account(self, request: Request, sign: int) -> None:
        if request.status not in COUNTED:
            return
        pending = self.pending[request.worker]
        pending[request.version] += sign
        if not pending[request.version]:
            del pending[request.version]
        if request.status is Status.BETWEEN_TURNS:
            between = self.between_turns[request.worker]
            between[request.version] += sign
            if not between[request.version]:
                del between[request.version]

    def _check_legal(self, request: Request, status: Status | None, why: str) -> None:
        if (request.status, status) not in LEGAL:
            raise IllegalTransition(self._describe(
                request, f"{why}: {getattr(request.status, 'value', None)} -> "
                         f"{getattr(status, 'value', None)}"))

    def _require(self, request: Request, status: Status, what: str) -> None:
        if request.status is not status:
            raise IllegalTransition(self._describe(request, f"{what} needs {status.value}"))

    @staticmethod
    def _describe(request: Request, what: str) -> str:
        state = getattr(request.status, "value", "done")
        return (f"request {request.id} ({state} on worker {request.worker}, version "
                f"{request.version}): illegal {what}; history: {request.history}")

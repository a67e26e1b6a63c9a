"""The ledger: every prompt group's lifecycle, kept so a run can prove that nothing was lost and
nothing was trained twice as fresh data, across worker failures, requeues and resumes.

States and the only legal moves (anything else raises `LedgerError`):

    QUEUED        -> GENERATING     start(worker, version)
    GENERATING    -> COLLECTED      collect
    GENERATING    -> QUEUED         requeue(reason)   its worker failed; it will start again
    COLLECTED     -> QUEUED         requeue_lost(reason)  a resume did not keep its output
    COLLECTED     -> TRAINED_FRESH  train_fresh(step)
    COLLECTED     -> EVICTED        evict(reason)     dropped before training (no signal, stale)
    TRAINED_FRESH -> IN_REPLAY      to_replay
    TRAINED_FRESH -> DONE           finish            replay off, or not kept for replay
    IN_REPLAY     -> IN_REPLAY      replayed(step)    one more reuse
    IN_REPLAY     -> EVICTED        evict(reason)     lag > δ, reuse bound, or capacity

- DONE is the end of a group used once (replay off, or not kept for replay).
- EVICTED is the end of a group removed with a reason: dropped after collection (e.g. dynamic
  sampling found no signal), or retired from replay (lag > δ, reuse bound, capacity).
- TRAINED_FRESH can be entered once per group id, so a group can never be fresh twice; a prompt
  trained twice can only come from two ids for the same (prompt, epoch), which
  `check_exactly_once` reports.

Events carry `step`: whatever integer the caller passes (`train_fresh`/`replayed` set it, and
the caller may set `ledger.step` directly). No clock: the same calls give the same ledger.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, NamedTuple


class State(str, Enum):
    QUEUED = "queued"
    GENERATING = "generating"
    COLLECTED = "collected"
    TRAINED_FRESH = "trained_fresh"
    IN_REPLAY = "in_replay"
    EVICTED = "evicted"
    DONE = "done"


LEGAL: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.GENERATING}),
    State.GENERATING: frozenset({State.COLLECTED, State.QUEUED}),
    State.COLLECTED: frozenset({State.TRAINED_FRESH, State.EVICTED, State.QUEUED}),
    State.TRAINED_FRESH: frozenset({State.IN_REPLAY, State.DONE}),
    State.IN_REPLAY: frozenset({State.IN_REPLAY, State.EVICTED}),
    State.EVICTED: frozenset(),
    State.DONE: frozenset(),
}


class LedgerError(RuntimeError):
    """An illegal transition or an unknown group: a bug in whoever drives the ledger."""


@dataclass(frozen=True, slots=True)
class Event:
    step: int
    state: State
    worker: int | None = None
    version: int | None = None
    reason: str | None = None


@dataclass(slots=True)
class GroupRecord:
    prompt_index: int
    epoch: int
    history: list[Event] = field(default_factory=list)
    reuses: int = 0

    @property
    def state(self) -> State:
        return self.history[-1].state


class ExactlyOnce(NamedTuple):
    """Prompts of an epoch not trained as fresh (`missing`: lost), trained fresh more than once
    (`duplicated`), and not trained because every group of theirs was deliberately evicted
    before training (`dropped`: recorded, not lost)."""

    missing: list[int]
    duplicated: list[int]
    dropped: list[int]

    @property
    def ok(self) -> bool:
        return not self.missing and not self.duplicated


class Ledger:
    def __init__(self) -> None:
        self.step = 0  # stamped on events; set by the caller
        self._groups: dict[str, GroupRecord] = {}

    # -- transitions ---------------------------------------------------------------------------

    def queue(self, group_id: str, prompt_index: int, epoch: int) -> None:
        if group_id in self._groups:
            raise LedgerError(f"group {group_id!r} is already in the ledger "
                              f"(state {self._groups[group_id].state.value})")
        self._groups[group_id] = GroupRecord(prompt_index, epoch,
                                             [Event(self.step, State.QUEUED)])

    def start(self, group_id: str, worker: int, version: int) -> None:
        self._move(group_id, State.GENERATING, worker=worker, version=version)

    def requeue(self, group_id: str, reason: str) -> None:
        """Its worker failed mid-generation: back to the queue, to be started again. A
        collected group keeps its output, so it is never requeued this way."""
        self._move(group_id, State.QUEUED, reason=reason, only_from=State.GENERATING)

    def requeue_lost(self, group_id: str, reason: str) -> None:
        """A resume from a checkpoint did not keep this group's output (it was generating,
        or collected and not yet trained): back to the queue, to be generated again."""
        self._move(group_id, State.QUEUED, reason=reason)

    def collect(self, group_id: str) -> None:
        self._move(group_id, State.COLLECTED)

    def train_fresh(self, group_id: str, step: int) -> None:
        self._move(group_id, State.TRAINED_FRESH, step=step)

    def to_replay(self, group_id: str) -> None:
        self._move(group_id, State.IN_REPLAY, only_from=State.TRAINED_FRESH)

    def replayed(self, group_id: str, step: int) -> None:
        self._move(group_id, State.IN_REPLAY, step=step, reason="replayed",
                   only_from=State.IN_REPLAY)
        self._groups[group_id].reuses += 1

    def finish(self, group_id: str) -> None:
        """Its fresh use was its only use (replay off, or not kept)."""
        self._move(group_id, State.DONE)

    def evict(self, group_id: str, reason: str) -> None:
        self._move(group_id, State.EVICTED, reason=reason)

    # -- queries -------------------------------------------------------------------------------

    def state(self, group_id: str) -> State:
        return self._record(group_id).state

    def history(self, group_id: str) -> list[Event]:
        return list(self._record(group_id).history)

    def reuses(self, group_id: str) -> int:
        return self._record(group_id).reuses

    def counts(self) -> dict[State, int]:
        counts = dict.fromkeys(State, 0)
        for record in self._groups.values():
            counts[record.state] += 1
        return counts

    def fresh_train_counts_by_prompt(self, epoch: int) -> dict[int, int]:
        """Times each prompt queued in `epoch` was trained as fresh data (0 if not yet)."""
        counts: dict[int, int] = {}
        for record in self._groups.values():
            if record.epoch == epoch:
                fresh = sum(e.state is State.TRAINED_FRESH for e in record.history)
                counts[record.prompt_index] = counts.get(record.prompt_index, 0) + fresh
        return counts

    def check_exactly_once(self, prompt_indices, epoch: int) -> ExactlyOnce:
        """Which of `prompt_indices` were not trained fresh in `epoch`, or more than once."""
        counts = self.fresh_train_counts_by_prompt(epoch)
        dropped_prompts = {r.prompt_index for r in self._groups.values()
                           if r.epoch == epoch and r.state is State.EVICTED
                           and not any(e.state is State.TRAINED_FRESH for e in r.history)}
        missing, duplicated, dropped = [], [], []
        for index in sorted(set(prompt_indices)):
            times = counts.get(index, 0)
            if times > 1:
                duplicated.append(index)
            elif times == 0:
                (dropped if index in dropped_prompts else missing).append(index)
        return ExactlyOnce(missing, duplicated, dropped)

    # -- checkpoints ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "groups": {
            gid: {"prompt_index": r.prompt_index, "epoch": r.epoch, "reuses": r.reuses,
                  "history": [{**asdict(e), "state": e.state.value} for e in r.history]}
            for gid, r in self._groups.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        ledger = cls()
        ledger.restore(data)
        return ledger

    def restore(self, data: dict[str, Any]) -> None:
        """Replace this ledger's contents with `to_dict` output, in place: the rollout holds
        this object, so a resume must not swap it for another."""
        self.step = data["step"]
        self._groups = {}
        for gid, r in data["groups"].items():
            history = [Event(**{**e, "state": State(e["state"])}) for e in r["history"]]
            self._groups[gid] = GroupRecord(r["prompt_index"], r["epoch"], history,
                                            r["reuses"])

    # -- internals -----------------------------------------------------------------------------

    def _record(self, group_id: str) -> GroupRecord:
        try:
            return self._groups[group_id]
        except KeyError:
            raise LedgerError(f"group {group_id!r} is not in the ledger") from None

    def _move(self, group_id: str, to: State, *, worker: int | None = None,
              version: int | None = None, reason: str | None = None,
              step: int | None = None, only_from: State | None = None) -> None:
        """`only_from` narrows LEGAL where one target has two verbs: entering replay
        (to_replay) versus another reuse in it (replayed); a worker's failure (requeue) versus
        a resume (requeue_lost)."""
        record = self._record(group_id)
        if to not in LEGAL[record.state] or (only_from and record.state is not only_from):
            raise LedgerError(f"group {group_id!r}: illegal transition "
                              f"{record.state.value} -> {to.value}")
        if step is not None:  # only after the move is known legal: a refusal changes nothing
            self.step = step
        if worker is None and to is not State.QUEUED:  # later events keep who made it
            worker, version = record.history[-1].worker, record.history[-1].version
        record.history.append(Event(self.step, to, worker, version, reason))

"""The elastic pool: Libra's non-blocking protocol for moving a worker between rollout and
training, as a sans-IO state machine. The runtime performs each returned `Action` (sleep an
engine, fetch trainer state, wire a replica to its pair) and reports what happened; the
protocol, and every decision of what to do next, lives here.

Training runs a fixed data-parallel group of core replicas. They never move, so the group's
communicators are never rebuilt: a borrowed worker trains as a replica paired with one core
replica, its gradients added to its pair's before the fixed all-reduce. States and the only
legal moves (anything else raises `PoolError`):

    ROLLOUT         -> REQUESTED        request_join     SLEEP_ENGINE
    REQUESTED       -> FETCHING_STATE   engine_slept     FETCH_STATE
    FETCHING_STATE  -> ZERO_SYNC        state_fetched    START_ZERO_GRADS
    ZERO_SYNC       -> ACTIVATING       step_boundary    ACTIVATE
    ACTIVATING      -> ACTIVE           step_boundary    NONE (its first real step is done)
    ACTIVE          -> RELEASING        request_leave    RELEASE_AT_BOUNDARY
    RELEASING       -> LOADING_WEIGHTS  step_boundary    DETACH_AND_WAKE
    LOADING_WEIGHTS -> ROLLOUT          weights_loaded   RETURN_TO_ROLLOUT
    (any other)     -> ROLLOUT          lost             REPLACE_WORKER

- ZERO_SYNC means "fetched, waiting for the barrier", not "fetching": FETCHING_STATE is the
  transfer, and only a worker holding a full copy is a replica. In ZERO_SYNC it follows its
  pair (applies each step's reduced update, so its weights and optimizer state stay current)
  while its own gradient counts as zero: no step waits for it. Seen from the trainer, this is
  the paper's "zero gradients while fetching": no step includes a joining worker's gradients.
- The set of contributors changes only at step boundaries (activation is a barrier; a leave,
  or a cancelled activation, stops contributing at the next one), except when a contributor
  fails: then its gradient for the step in flight is dropped.
- `cancel` undoes the move in flight: a join returns to rollout (REQUESTED, FETCHING_STATE,
  ZERO_SYNC at once with its cleanup; ACTIVATING via RELEASING at the next boundary), a leave
  still RELEASING returns to ACTIVE. Once a leave has detached (LOADING_WEIGHTS) undoing it is
  a full join, which the caller must request explicitly once the worker is back.
- `failed` always ends in rollout, the home role of every movable worker: a failed replica
  cannot resume training without a new join. A failure while LOADING_WEIGHTS retries the load.
- `lost`: the worker's process is gone (a replica killed mid-step: the runtime reran the step
  without it). Whatever its move, it is forgotten: back in the pool as a rollout worker, its
  action REPLACE_WORKER (the rollout replaces its process as for any lost rollout worker;
  nothing is woken or loaded, there is nothing to wake).
- Every move has a generation: request_join, request_leave, cancel, failed and lost start a
  new one. Reports (engine_slept, state_fetched, weights_loaded, failed) carry the generation
  of the action they answer; a stale one is ignored and logged (a late "state fetched" of a
  cancelled join activates nothing), a future one is a bug and raises.

Sans-IO: no clock, no threads. `step` is the last step boundary the runtime reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from ..validation import check_range, contradiction


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    enabled: bool = False
    min_rollout_workers: int = 1  # a join never leaves fewer serving rollout workers
    min_train_workers: int = 1  # a leave never leaves fewer training workers
    max_borrowed: int = 1  # rollout workers training (or joining) at once
    # Moves pinned by the operator, e.g. ["3 join 1", "6 leave 1"]: after step 3 rollout
    # worker 1 joins training, after step 6 it leaves (with or without the adaptive scheduler).
    schedule: list[str] = field(default_factory=list)

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.min_rollout_workers", self.min_rollout_workers, 1)
        check_range(f"{prefix}.min_train_workers", self.min_train_workers, 1)
        check_range(f"{prefix}.max_borrowed", self.max_borrowed, 0)
        if self.enabled and self.max_borrowed == 0:
            raise contradiction(f"{prefix}.enabled = True with {prefix}.max_borrowed = 0: no "
                                "worker could ever move. Set max_borrowed >= 1 or enabled = False")


class Role(str, Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"


class State(str, Enum):
    ROLLOUT = "rollout"
    REQUESTED = "requested"
    FETCHING_STATE = "fetching_state"
    ZERO_SYNC = "zero_sync"
    ACTIVATING = "activating"
    ACTIVE = "active"
    RELEASING = "releasing"
    LOADING_WEIGHTS = "loading_weights"


class Do(str, Enum):
    """What the runtime must do for a transition. `peer` in the action names the core replica."""

    SLEEP_ENGINE = "sleep_engine"  # finish or requeue its requests, sleep the engine, free memory
    FETCH_STATE = "fetch_state"  # fetch peer's weights + optimizer state asynchronously, plus
    #                              the updates of steps done meanwhile: report a current copy
    START_ZERO_GRADS = "start_zero_grads"  # follow peer's updates, contribute zero gradients
    ACTIVATE = "activate"  # from the next step, add its real gradients to peer's
    RELEASE_AT_BOUNDARY = "release_at_boundary"  # keep contributing to the step in flight only
    DETACH_AND_WAKE = "detach_and_wake"  # unpair from peer, free training state, wake, load
    ABORT_FETCH_AND_WAKE = "abort_fetch_and_wake"  # cancel the fetch, free it, wake, load
    DROP_GRADIENTS_AND_WAKE = "drop_gradients_and_wake"  # peer adds none of its gradients to
    #                                                      the step in flight; then as DETACH
    WAKE_ENGINE_AND_LOAD = "wake_engine_and_load"  # wake the engine, load the latest weights
    RETURN_TO_ROLLOUT = "return_to_rollout"  # dispatch rollout requests to it again
    REPLACE_WORKER = "replace_worker"  # its process is gone: a new one serves rollout once up
    NONE = "none"  # bookkeeping only: nothing changes on the data path


S = State
TRANSITIONS: dict[tuple[State, str], tuple[State, Do]] = {
    (S.ROLLOUT, "request_join"): (S.REQUESTED, Do.SLEEP_ENGINE),
    (S.REQUESTED, "engine_slept"): (S.FETCHING_STATE, Do.FETCH_STATE),
    (S.FETCHING_STATE, "state_fetched"): (S.ZERO_SYNC, Do.START_ZERO_GRADS),
    (S.ZERO_SYNC, "step_boundary"): (S.ACTIVATING, Do.ACTIVATE),
    (S.ACTIVATING, "step_boundary"): (S.ACTIVE, Do.NONE),
    (S.ACTIVE, "request_leave"): (S.RELEASING, Do.RELEASE_AT_BOUNDARY),
    (S.RELEASING, "step_boundary"): (S.LOADING_WEIGHTS, Do.DETACH_AND_WAKE),
    (S.LOADING_WEIGHTS, "weights_loaded"): (S.ROLLOUT, Do.RETURN_TO_ROLLOUT),
    (S.REQUESTED, "cancel"): (S.LOADING_WEIGHTS, Do.WAKE_ENGINE_AND_LOAD),
    (S.FETCHING_STATE, "cancel"): (S.LOADING_WEIGHTS, Do.ABORT_FETCH_AND_WAKE),
    (S.ZERO_SYNC, "cancel"): (S.LOADING_WEIGHTS, Do.DETACH_AND_WAKE),
    (S.ACTIVATING, "cancel"): (S.RELEASING, Do.RELEASE_AT_BOUNDARY),
    (S.RELEASING, "cancel"): (S.ACTIVE, Do.NONE),  # it never stopped contributing
    (S.REQUESTED, "failed"): (S.LOADING_WEIGHTS, Do.WAKE_ENGINE_AND_LOAD),
    (S.FETCHING_STATE, "failed"): (S.LOADING_WEIGHTS, Do.ABORT_FETCH_AND_WAKE),
    (S.ZERO_SYNC, "failed"): (S.LOADING_WEIGHTS, Do.DETACH_AND_WAKE),
    (S.ACTIVATING, "failed"): (S.LOADING_WEIGHTS, Do.DROP_GRADIENTS_AND_WAKE),
    (S.ACTIVE, "failed"): (S.LOADING_WEIGHTS, Do.DROP_GRADIENTS_AND_WAKE),
    (S.RELEASING, "failed"): (S.LOADING_WEIGHTS, Do.DROP_GRADIENTS_AND_WAKE),
    (S.LOADING_WEIGHTS, "failed"): (S.LOADING_WEIGHTS, Do.WAKE_ENGINE_AND_LOAD),  # retry
    # a lost rollout worker in ROLLOUT is the rollout's alone (core/moves.py `worker_lost`)
    **{(state, "lost"): (S.ROLLOUT, Do.REPLACE_WORKER) for state in State
       if state is not S.ROLLOUT},
}
NEW_MOVE = frozenset({"request_join", "request_leave", "cancel", "failed", "lost"})
AT_BOUNDARY = frozenset(state for state, event in TRANSITIONS if event == "step_boundary")
CONTRIBUTING = frozenset({S.ACTIVATING, S.ACTIVE, S.RELEASING})
ROLLOUT_SIDE = frozenset({S.ROLLOUT, S.LOADING_WEIGHTS})


def role_of(state: State) -> Role:
    """The role a worker serves or is heading to: training from its join request until it
    detaches, rollout from then on."""
    return Role.ROLLOUT if state in ROLLOUT_SIDE else Role.TRAIN


class PoolError(RuntimeError):
    """An illegal transition, an unknown worker or a move of a core replica: a bug in whoever
    drives the pool."""


@dataclass(frozen=True, slots=True)
class Action:
    kind: Do
    worker: int
    generation: int  # reports answering this action must carry it
    peer: int | None  # the core replica it pairs with (None when it has none)
    reason: str


class Transition(NamedTuple):
    step: int
    worker: int
    from_state: State
    to_state: State
    reason: str


@dataclass(slots=True)
class _Worker:
    state: State
    generation: int = 0


class ElasticPool:
    def __init__(self, workers: dict[int, Role | str], core_train_replicas: list[int],
                 config: ElasticConfig | None = None) -> None:
        self.config = config or ElasticConfig()
        roles = {worker: Role(role) for worker, role in workers.items()}
        if not core_train_replicas:
            raise PoolError("the pool needs at least one core training replica")
        for core in core_train_replicas:
            if roles.get(core) is not Role.TRAIN:
                got = f"role {roles[core].value!r}" if core in roles else "no such worker"
                raise PoolError(f"core replica {core} must be a worker with role 'train'; got "
                                f"{got}")
        self.core = frozenset(core_train_replicas)
        self.step = 0
        self.timeline: list[Transition] = []
        self._workers = {w: _Worker(S.ACTIVE if role is Role.TRAIN else S.ROLLOUT)
                         for w, role in sorted(roles.items())}
        self._pair: dict[int, int] = {}  # joined replica -> core replica
        for worker in self._workers:  # train workers outside the core: already joined
            if worker not in self.core and roles[worker] is Role.TRAIN:
                self._pair[worker] = self._least_paired_core()

    # -- moves the controller asks for -----------------------------------------------------

    def request_join(self, worker: int) -> Action:
        """Start borrowing a rollout worker for training."""
        if self._is_movable_in(worker, S.ROLLOUT) and worker not in self.joinable():
            if len(self.borrowed()) >= self.config.max_borrowed:
                why = (f"{len(self.borrowed())} worker(s) already borrowed, max_borrowed = "
                       f"{self.config.max_borrowed}")
            else:
                why = (f"it would leave fewer than min_rollout_workers = "
                       f"{self.config.min_rollout_workers} serving rollout")
            raise PoolError(f"worker {worker}: request_join refused: {why}")
        return self._move(worker, "request_join")

    def request_leave(self, worker: int) -> Action:
        """Give a borrowed worker back to rollout: it stops contributing at the next boundary."""
        if self._is_movable_in(worker, S.ACTIVE) and worker not in self.leavable():
            raise PoolError(f"worker {worker}: request_leave refused: it would leave fewer than "
                            f"min_train_workers = {self.config.min_train_workers} training")
        return self._move(worker, "request_leave")

    def cancel(self, worker: int) -> Action:
        return self._move(worker, "cancel")

    # -- what the runtime reports ----------------------------------------------------------

    def engine_slept(self, worker: int, generation: int) -> Action | None:
        return self._report(worker, "engine_slept", generation)

    def state_fetched(self, worker: int, generation: int) -> Action | None:
        return self._report(worker, "state_fetched", generation)

    def weights_loaded(self, worker: int, generation: int) -> Action | None:
        return self._report(worker, "weights_loaded", generation)

    def failed(self, worker: int, reason: str, generation: int | None = None) -> Action | None:
        """A move's action failed (`generation`: the action's), or the worker itself did
        (None: whatever it was doing)."""
        if generation is None:
            return self._move(worker, "failed", reason)
        return self._report(worker, "failed", generation, reason)

    def lost(self, worker: int, reason: str) -> Action:
        """The worker's process is gone, mid-move or training: the pool forgets the move (a
        new generation, so the reports of actions in flight are stale)."""
        return self._move(worker, "lost", reason)

    def step_boundary(self, step: int) -> list[Action]:
        """The trainer finished step `step` (strictly increasing): the barrier where joins
        activate, first contributing steps complete and leaves detach."""
        if step <= self.step:
            raise PoolError(f"step_boundary({step}) after step {self.step}: steps must increase")
        self.step = step
        due = [w for w, record in self._workers.items()
               if w not in self.core and record.state in AT_BOUNDARY]
        return [self._move(worker, "step_boundary") for worker in due]

    # -- queries ---------------------------------------------------------------------------

    def role(self, worker: int) -> Role:
        return role_of(self.state(worker))

    def state(self, worker: int) -> State:
        return self._record(worker).state

    def generation(self, worker: int) -> int:
        return self._record(worker).generation

    def pairing(self) -> dict[int, int]:
        """Each replica outside the core (joining, training or releasing) -> its core replica."""
        return dict(self._pair)

    def contributors(self) -> list[int]:
        """Workers whose gradients count in the step in flight."""
        return [w for w, record in self._workers.items()
                if w in self.core or record.state in CONTRIBUTING]

    def rollout_workers(self) -> list[int]:
        """Workers that may take rollout requests now."""
        return [w for w, record in self._workers.items() if record.state is S.ROLLOUT]

    def borrowed(self) -> list[int]:
        """Workers outside the core on the training side (joining, training or releasing)."""
        return [w for w in self._workers if w not in self.core and self.role(w) is Role.TRAIN]

    def joinable(self) -> list[int]:
        """Rollout workers that may be asked to join now, within the config's limits."""
        rollout = self.rollout_workers()
        if (len(self.borrowed()) >= self.config.max_borrowed
                or len(rollout) - 1 < self.config.min_rollout_workers):
            return []
        return rollout

    def leavable(self) -> list[int]:
        """Borrowed workers that may be asked to leave now, within the config's limits."""
        training = [w for w, record in self._workers.items()
                    if w in self.core or record.state in (S.ACTIVATING, S.ACTIVE)]
        if len(training) - 1 < self.config.min_train_workers:
            return []
        return [w for w in training if w not in self.core and self.state(w) is S.ACTIVE]

    # -- internals -------------------------------------------------------------------------

    def _record(self, worker: int) -> _Worker:
        try:
            return self._workers[worker]
        except KeyError:
            raise PoolError(f"worker {worker} is not in the pool") from None

    def _is_movable_in(self, worker: int, state: State) -> bool:
        return worker not in self.core and self._record(worker).state is state

    def _least_paired_core(self) -> int:
        load = {core: 0 for core in self.core}
        for core in self._pair.values():
            load[core] += 1
        return min(load, key=lambda core: (load[core], core))

    def _report(self, worker: int, event: str, generation: int,
                detail: str = "") -> Action | None:
        record = self._record(worker)
        if generation > record.generation:
            raise PoolError(f"worker {worker}: {event} for generation {generation}, but the "
                            f"pool is only at generation {record.generation}")
        if generation < record.generation:
            self.timeline.append(Transition(
                self.step, worker, record.state, record.state,
                f"ignored stale {event} (generation {generation}, current {record.generation})"))
            return None
        return self._move(worker, event, detail)

    def _move(self, worker: int, event: str, detail: str = "") -> Action:
        record = self._record(worker)
        if worker in self.core:
            raise PoolError(f"worker {worker}: illegal event {event!r}: it is a core training "
                            "replica, a fixed member of the data-parallel group that never moves")
        try:
            to, kind = TRANSITIONS[record.state, event]
        except KeyError:
            raise PoolError(f"worker {worker}: illegal event {event!r} in state "
                            f"{record.state.value}") from None
        if event in NEW_MOVE:
            record.generation += 1
        if role_of(record.state) is Role.ROLLOUT and role_of(to) is Role.TRAIN:
            self._pair[worker] = self._least_paired_core()
        peer = self._pair.get(worker)
        if role_of(to) is Role.ROLLOUT:
            self._pair.pop(worker, None)
        reason = f"{event}: {detail}" if detail else event
        self.timeline.append(Transition(self.step, worker, record.state, to, reason))
        record.state = to
        return Action(kind, worker, record.generation, peer, reason)

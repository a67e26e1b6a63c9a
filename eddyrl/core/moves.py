"""Moving requests between rollout workers, every kind of move in one place; each is a
transition of the request table (`core/requests.py`), which keeps the counts.

- `published`: new weights reached the workers; the assignment relabels requests queued for a
  superseded version (with partial rollout, every request goes on with the new weights).
- `rebalance` (DORA): the assignment's plan consolidates a legacy version onto its share of
  workers and evacuates workers lent to training; a running request is aborted on its source
  (MOVING) and resumes on the target from its partial output, an episode between turns just
  takes its next turn there (no abort).
- `route` (Libra): at a length milestone the placement may move a request to a worker of
  another bucket that can run its version now: the same abort/resume.
- `restart`: the last resort when a request's version is gone from every worker (an engine
  refused it, or an episode's next turn found no host) or its worker was lost: C1 forbids
  finishing it on other weights, so it is regenerated from scratch on the latest version
  (parked while no worker is available, placed when one comes back: `take_back`).
- `worker_lost`: a worker's process died with the requests it ran; they restart, and the
  runtime replaces the worker, which takes work again once the next weight sync reaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import WorkerLost
from ..protocol import GenerationResult, ToolState
from ..runtime_protocol import Recoverable, Runtime
from .ledger import Ledger
from .placement import GroupPlacement, RoutedPlacement
from .requests import Request, RequestTable, Status
from .streams import Streams
from .version_assignment import VersionAssignment

if TYPE_CHECKING:  # annotations only: episodes.py brings in the environments
    from .episodes import Episodes, NoEpisodes

LOST = "worker_lost"  # the reason a lost worker's requests restart (ledger, episode metrics)


class CannotReplace(Exception):
    """What `NoRecovery` answers: the runtime starts no new worker processes."""


class NoRecovery:
    """The recovery of a runtime that is not `runtime_protocol.Recoverable`: a lost worker
    ends the run, named."""

    async def replace_worker(self, worker: int) -> int:
        raise CannotReplace(worker)


class Moves:
    def __init__(self, runtime: Runtime, assignment: VersionAssignment, table: RequestTable,
                 streams: Streams,
                 placement: GroupPlacement | RoutedPlacement,
                 episodes: Episodes | NoEpisodes, ledger: Ledger,
                 recovery: Recoverable | NoRecovery, *, partial_rollout: bool,
                 migrate: bool) -> None:
        self.runtime = runtime
        self.assignment = assignment
        self.table = table  # the rollout's, which the assignment follows too
        self.streams = streams
        self.placement = placement
        self.episodes = episodes  # an episode restarts fresh
        self.ledger = ledger
        self.recovery = recovery
        self.partial_rollout = partial_rollout
        self.migrate = migrate
        self.workers_lost = 0
        self.replacing: set[int] = set()  # lost workers not back yet
        # replaced workers whose version this rollout has not been told of yet (`published`)
        self._replaced: dict[int, int] = {}

    # -- versions ------------------------------------------------------------------------------

    def published(self, version: int, hosted: list[int]) -> None:
        """New weights reached every worker; `hosted` is what each one now generates with
        (-1: a worker being replaced, whose weights the runtime does not know yet)."""
        hosted = [h if h >= 0 else self.assignment.hosted[w] for w, h in enumerate(hosted)]
        self.assignment.published(version, hosted, adopt=self.partial_rollout)
        for worker in [w for w, v in self._replaced.items() if v <= version]:
            self.replacing.discard(worker)  # replaced with weights this rollout now knows
            self.take_back(worker, max(self._replaced.pop(worker), hosted[worker]))

    def use_partial_rollout(self, on: bool) -> None:
        """Partial rollout on or off from now on (the adaptive scheduler's plan switched it)."""
        self.partial_rollout = on

    def holding(self) -> list[int]:
        """Workers whose hosted weights episodes between turns will come back for: a weight
        sync stages the new version there even if the engine is idle (it applies once a
        newer request finds nothing of the old running), so those episodes keep their version
        instead of starting over. None with partial rollout (turns go on with new weights)."""
        if self.partial_rollout:
            return []
        return [w for w, waiting in enumerate(self.assignment.between_turns)
                if waiting.get(self.assignment.hosted[w])]

    async def rebalance(self, new_requests: int) -> int:
        """DORA's reassignment after a train step: consolidate legacy versions onto their share
        of workers by aborting requests on evacuated workers and resuming them (same version)
        on the hosts that keep it; workers lent to training are evacuated the same way.
        Returns the requests set moving."""
        if self.partial_rollout:
            return 0  # every worker already runs the latest weights: lent ones just drain
        moving = 0
        self.assignment.observed_kv([s.kv_cache_usage for s in
                                     await self.runtime.worker_stats()])
        for move in self.assignment.plan(new_requests):
            if not self.migrate and self.assignment.available[move.source]:
                continue  # consolidation off; evacuating a lent worker is still needed
            chosen = [r for r in self.table.counted_on(move.source)
                      if r.version == move.version
                      and r.status in (Status.RUNNING, Status.BETWEEN_TURNS)][:move.count]
            running = []
            for request in chosen:
                if request.status is Status.BETWEEN_TURNS:
                    self.table.move_between_turns(request.id, move.target, "dora")
                else:
                    self.table.move(request.id, move.target, "dora")
                    running.append(request.id)
            moving += len(chosen)
            if running:
                await self.streams.abort_now(move.source, running)
        return moving

    # -- elastic pool --------------------------------------------------------------------------

    async def lend(self, worker: int) -> int:
        """Stop giving `worker` work and move its running requests elsewhere where another
        worker hosts their version; returns the requests still running on it (they finish
        there: `running_on` says when it is empty)."""
        self.assignment.set_available(worker, False)
        await self.rebalance(0)
        return self.running_on(worker)

    def running_on(self, worker: int) -> int:
        return self.table.load(worker)

    def take_back(self, worker: int, hosted_version: int) -> None:
        """`worker` is a rollout worker again, hosting `hosted_version`; requests waiting for
        any worker (all were lost) start now."""
        self.assignment.take_back(worker, hosted_version)
        for request in self.table.with_status(Status.PARKED):
            self._place(request)

    # -- restarts and routed moves -------------------------------------------------------------

    def restart(self, request: Request, reason: str) -> None:
        """The request's version is gone (`reason`: "refused", its worker's engine no longer
        had the weights, the book being behind it; "version_retired", no worker hosted it any
        more when an episode's next turn came; `LOST`, its worker's process died). C1 forbids
        finishing it on other weights, so it is regenerated from scratch on the latest version:
        one version per trajectory, no sample lost. Its group keeps its dispatch version in the
        window, which only makes the staleness bound conservative. With no worker available
        (all lost), it waits for a replacement (`take_back`)."""
        self.table.restart(request.id, reason)
        if request.episode is not None:  # an episode restarts too, in a fresh environment
            self.streams.start_task(self.streams.guarded(self.episodes.close(request.episode)))
            request.episode = self.episodes.restart(request.episode, reason)
        self.placement.cancel(request.id)
        self._place(request)

    def _place(self, request: Request) -> None:
        """Start a parked request from scratch on the latest version, where the placement
        puts a new one; it stays parked while no worker can take it."""
        version = self.assignment.latest
        worker = self.placement.place_again(request.id, request.group.prompt, version)
        if worker is None:
            return
        self.table.place(request.id, worker, version)
        self.streams.send(request)

    def route(self, request: Request, progress: GenerationResult) -> None:
        """A length milestone: ask the placement whether the request belongs in another
        bucket now, and move it there (abort, resume on the target) if so. The target must be
        able to run the request's version at once (C1)."""
        if request.status is not Status.RUNNING:
            return  # already on its way somewhere
        allowed = self.allowed_targets(request)
        if not allowed:
            return
        target = self.placement.progress(request.id, len(progress.token_ids), allowed)
        if target is None:
            return
        source = request.worker
        self.table.move(request.id, target, "routed")
        self.streams.abort(source, request.id)

    def allowed_targets(self, request: Request) -> list[int]:
        """Workers a request may move to: those that can run its version now."""
        if self.partial_rollout:
            return [w for w in range(self.assignment.num_workers)
                    if self.assignment.available[w]]
        return self.assignment.hosts_now(request.version)

    def nearest_host(self, request: Request) -> int | None:
        """The least-loaded worker that can run the request's version now, if any."""
        hosts = self.allowed_targets(request)
        return min(hosts, key=lambda w: (self.table.load(w), w)) if hosts else None

    # -- an episode between turns ----------------------------------------------------------------

    def next_turn_worker(self, request: Request) -> int | None:
        """C1 between turns: the next turn stays on its worker if that is still available (not
        lost, not lent to training) and hosts the episode's version (or the version is the
        latest, which the worker switches to); else it goes to another host of the version.
        None: no host left (the episode starts over on the latest version)."""
        worker, assignment = request.worker, self.assignment
        if assignment.available[worker] and (
                self.partial_rollout
                or request.version in (assignment.hosted[worker], assignment.latest)):
            return worker
        return self.nearest_host(request)

    def tool_returned(self, request: Request, state: ToolState, tokens: int) -> None:
        """Libra: a tool returned `state` after `tokens` output tokens; the placement records
        it and may send the request's next turn to another bucket (nothing runs: no abort)."""
        allowed = self.allowed_targets(request) or [request.worker]  # record only
        target = self.placement.tool_state(request.id, state, tokens, allowed)
        if target is not None and target != request.worker:
            self.table.move_between_turns(request.id, target, "tool_state")

    # -- resumes -------------------------------------------------------------------------------

    def resume(self, request: Request, partial: GenerationResult) -> None:
        """Continue the request on its worker from `partial`'s tokens (a migration's abort, or
        an episode's transcript). A worker lost since the move was decided is replaced by
        another host of the version, if any; else the request starts over."""
        if request.worker in self.replacing:
            target = self.nearest_host(request)
            if target is None:
                self.restart(request, LOST)
                return
            self.table.redirect(request.id, target, "target_lost")
        self.streams.send(request, partial)

    # -- lost workers --------------------------------------------------------------------------

    def worker_lost(self, worker: int, lost: WorkerLost | str) -> None:
        """`worker`'s process is gone, with the requests it ran and their partial output. Each
        is regenerated from scratch on another worker (C1; on the latest version, as any
        restart; its group keeps its dispatch version in the window): those running there,
        those whose abort it never answered (moving away from it), and those whose resume was
        still batched for it. One moving to it goes elsewhere when its partial output arrives
        (`resume`); an episode between turns takes its next turn elsewhere (its transcript is
        here). The ledger records each affected group's requeue. The runtime then replaces the
        worker; it gets work again once a weight sync reaches it (`published`)."""
        reason = str(lost)
        self.streams.incarnation[worker] += 1
        self.workers_lost += 1
        self.assignment.set_available(worker, False, lost=True)
        self.replacing.add(worker)
        self.streams.forget_worker(worker)  # never sent: those requests restart below
        victims = []
        for request in self.table:
            if request.status is Status.MOVING and request.source == worker:
                self.table.arrive(request.id, resumed=False)  # its partial output is gone
                victims.append(request)
            elif request.status is Status.RUNNING and request.worker == worker:
                victims.append(request)
        groups: dict[str, Request] = {}
        for request in victims:
            self.restart(request, LOST)
            # Every group the ledger follows records the loss: a synchronous refill's group
            # too (`generate_now` started it there, its samples are trained), not only a
            # dispatched one's; the ledger's contract is that a group whose worker failed
            # goes back to QUEUED and starts again. Evaluation groups are in no ledger.
            if request.purpose.in_ledger:
                groups[request.group.group_id] = request
        for group_id, request in groups.items():
            self.ledger.requeue(group_id, f"rollout worker {worker} lost: {reason}")
            self.ledger.start(group_id, request.worker, request.group.dispatch_version)
        self.streams.start_task(self._replace(worker, reason))

    async def _replace(self, worker: int, reason: str) -> None:
        """Have the runtime start a new process for `worker`; it comes back with the weights
        of the version the runtime last published (if this rollout has not heard of that
        version yet, `published` takes it back)."""
        try:
            version = await self.recovery.replace_worker(worker)
        except CannotReplace:
            self.streams.fail(WorkerLost(worker, "generation", f"{reason}; this runtime "
                                         "cannot replace workers"))
            return
        except BaseException as exc:  # surfaced to whoever waits next
            self.streams.fail(exc)
            return
        if version <= self.assignment.latest:
            self.replacing.discard(worker)
            self.take_back(worker, version)
        else:
            self._replaced[worker] = version

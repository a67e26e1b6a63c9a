"""Moving running requests between rollout workers: the half of `StreamingRollout` that follows
the assignment's book of which worker hosts which version.

- `published`: new weights reached the workers; requests queued for a superseded version are
  relabelled (with partial rollout, every request goes on with the new weights).
- `rebalance` (DORA): the assignment's plan consolidates a legacy version onto its share of
  workers and evacuates workers lent to training; a running request is aborted on its source
  and resumed on the target from its partial output, an episode between turns just takes its
  next turn there (no abort).
- `route` (Libra): at a length milestone the bucket router may move a request to a worker of
  another bucket that can run its version now: the same abort/resume.
- `_restart`: the last resort when a request's version is gone from every worker (an engine
  refused it, or an episode's next turn found no host): C1 forbids finishing it on other
  weights, so it is regenerated from scratch on the latest version.
- `worker_lost`: a worker's process died with the requests it ran; they are regenerated the
  same way, and the runtime replaces the worker, which takes work again once the next weight
  sync has reached it.

Aborts and resumes of one moment are sent as one call per worker (`_flush`). A mixin: the
state (requests, counters, queues) is `StreamingRollout`'s; `_launch_all`, `_request`,
`_track` and `_fail` are its request plumbing.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..protocol import GenerationRequest, GenerationResult
from ..errors import WorkerLost
from .version_assignment import VersionAssignment

if TYPE_CHECKING:
    from ..scheduler.buckets import BucketRouter
    from .episodes import Episodes, NoEpisodes
    from .rollout import _Request


LOST = "worker_lost"  # the reason a lost worker's requests restart (ledger, episode metrics)


class CannotReplace(Exception):
    """What `NoRecovery` answers: the runtime starts no new worker processes."""


class NoRecovery:
    """The recovery of a runtime that is not `runtime.protocol.Recoverable`: a lost worker
    ends the run, named."""

    async def replace_worker(self, worker: int) -> int:
        raise CannotReplace(worker)


class RolloutMigration:
    runtime: Any
    recovery: Any  # runtime.protocol.Recoverable, or NoRecovery
    assignment: VersionAssignment
    router: BucketRouter | None
    episodes: Episodes | NoEpisodes
    partial_rollout: bool
    migrate: bool
    _requests: dict[str, _Request]
    _resume: dict[int, list[GenerationRequest]]
    _abort: dict[int, list[str]]
    _flush_scheduled: bool
    migrated: int
    restarted: int
    routed: int
    regenerated: int
    workers_lost: int
    _incarnation: dict[int, int]
    _replacing: set[int]
    _parked: list[str]
    _replaced: dict[int, int]
    ledger: Any

    # -- versions ------------------------------------------------------------------------------

    def published(self, version: int, hosted: list[int]) -> None:
        """New weights reached every worker; `hosted` is what each one now generates with.
        Requests still queued for an older staged version will start on this one (the engine
        applies the newest staged weights); their group keeps its dispatch version for the
        window, which only makes the staleness bound more conservative."""
        # -1: a worker being replaced (the runtime does not know its weights yet)
        hosted = [h if h >= 0 else self.assignment.hosted[w] for w, h in enumerate(hosted)]
        self.assignment.published(version, hosted)
        for worker in [w for w, v in self._replaced.items() if v <= version]:
            self._replacing.discard(worker)  # replaced with weights this rollout now knows
            self.take_back(worker, max(self._replaced.pop(worker), hosted[worker]))
        if self.partial_rollout:  # running requests go on with the new weights
            self.assignment.adopt_latest()
        for request in self._requests.values():
            if self.partial_rollout or hosted[request.worker] < request.version < version:
                request.version = version

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
            ids = [rid for rid, r in self._requests.items()
                   if r.worker == move.source and r.version == move.version
                   and r.moving_to is None][:move.count]
            running = []
            for rid in ids:
                request = self._requests[rid]
                if request.episode is not None and request.episode.stepping:
                    self._move_between_turns(request, move.target)
                else:
                    running.append(rid)
                if self.router is not None:
                    self.router.relocate(rid, move.target)
            moving += len(ids)
            if running:
                self.assignment.moved(move.source, move.target, move.version, len(running))
                for rid in running:
                    self._requests[rid].moving_to = move.target
                await self.runtime.abort(move.source, running)
        return moving

    def _move_between_turns(self, request: _Request, target: int) -> None:
        """An episode whose engine is not running it (between turns, or about to resume)
        takes its next turn on `target`, which hosts its version: nothing to abort."""
        self.assignment.moved(request.worker, target, request.version,
                                between_turns=request.episode.stepping)
        request.worker = target
        self.migrated += 1

    # -- elastic pool --------------------------------------------------------------------------

    async def lend(self, worker: int) -> int:
        """Stop giving `worker` work and move its running requests elsewhere where another
        worker hosts their version; returns the requests still running on it (they finish
        there: `running_on` says when it is empty)."""
        self.assignment.set_available(worker, False)
        await self.rebalance(0)
        return self.running_on(worker)

    def running_on(self, worker: int) -> int:
        return sum(self.assignment.pending[worker].values())

    def take_back(self, worker: int, hosted_version: int) -> None:
        """`worker` is a rollout worker again, hosting `hosted_version`; requests waiting for
        any worker (all were lost) start now."""
        self.assignment.hosted[worker] = hosted_version
        self.assignment.set_available(worker, True)
        parked, self._parked = self._parked, []
        for request_id in parked:
            self._place_again(request_id, self._requests[request_id])

    # -- restarts and routed moves -------------------------------------------------------------

    def _restart(self, request: _Request, request_id: str, reason: str) -> None:
        """The request's version is gone (`reason`: "refused", its worker's engine no longer
        had the weights, the book being behind it; "version_retired", no worker hosted it any
        more when an episode's next turn came; `LOST`, its worker's process died). C1 forbids
        finishing it on other weights, so it is regenerated from scratch on the latest version:
        one version per trajectory, no sample lost. Its group keeps its dispatch version in the
        window, which only makes the staleness bound conservative. With no worker available
        (all lost), it waits for a replacement (`take_back`)."""
        self.assignment.finished(request.worker, request.version)
        if request.episode is not None:  # an episode restarts too, in a fresh environment
            self._track(self.episodes.close(request.episode))
            request.episode = self.episodes.restart(request.episode, reason)
        if reason == LOST:
            self.regenerated += 1
        else:
            self.restarted += 1
        if not any(self.assignment.available):
            self._parked.append(request_id)
            return
        self._place_again(request_id, request)

    def _place_again(self, request_id: str, request: _Request) -> None:
        """Start the request from scratch on the latest version, where the router or the
        assignment puts a new one."""
        request.version = self.assignment.latest
        if self.router is not None:  # from scratch: a new path, from the smallest bucket
            self.router.cancel(request_id)
            request.worker = self.router.start(request_id, request.group.prompt,
                                               self.assignment.eligible(request.version)
                                               ).instance
        else:
            request.worker = self.assignment.pick(request.version)
        self.assignment.dispatched(request.worker, request.version)
        self._launch_all({request.worker: [self._request(
            request_id, request.group.prompt_ids, request.sampling, request.version,
            request.priority)]})

    def _route(self, request_id: str, request: _Request, progress: GenerationResult) -> None:
        """A length milestone: ask the router whether the request belongs in another bucket
        now, and move it there (abort, resume on the target) if so. The target must be able
        to run the request's version at once (C1)."""
        if self.router is None or request.moving_to is not None:
            return  # already on its way somewhere
        allowed = self._allowed_targets(request)
        if not allowed:
            return
        move = self.router.on_progress(request_id, len(progress.token_ids), allowed)
        if move is None:
            return
        self.assignment.moved(move.source.instance, move.target.instance, request.version)
        request.moving_to = move.target.instance
        self.routed += 1
        self._abort.setdefault(move.source.instance, []).append(request_id)
        self._schedule_flush()

    def _allowed_targets(self, request: _Request) -> list[int]:
        """Workers the router may move the request to: those that can run its version now."""
        if self.partial_rollout:
            return [w for w in range(self.assignment.num_workers)
                    if self.assignment.available[w]]
        return self.assignment.hosts_now(request.version)

    # -- resumes and aborts, batched per worker ------------------------------------------------

    def _queue_resume(self, request: _Request, partial: GenerationResult) -> None:
        """Continue the request on its worker from `partial`'s tokens (a migration's abort, or
        an episode's transcript), batched per worker with the others of this moment. A worker
        lost since the move was decided is replaced by another host of the version, if any;
        else the request starts over."""
        if request.worker in self._replacing:
            hosts = self.assignment.hosts_now(request.version)
            if not hosts:
                self._restart(request, partial.request_id, LOST)
                return
            target = self.assignment.pick(request.version)
            self.assignment.moved(request.worker, target, request.version)
            request.worker = target
        self._resume.setdefault(request.worker, []).append(self._request(
            partial.request_id, partial.prompt_ids, request.sampling, request.version,
            request.priority, partial))
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            # Results of one decode step arrive together: abort and resume them as one call
            # per worker.
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        resume, self._resume = self._resume, {}
        aborts, self._abort = self._abort, {}
        self._launch_all(resume)
        for worker, ids in aborts.items():
            self._track(self._abort_on(worker, ids))

    async def _abort_on(self, worker: int, request_ids: list[str]) -> None:
        incarnation = self._incarnation.get(worker, 0)
        try:
            await self.runtime.abort(worker, request_ids)
        except WorkerLost as lost:
            if self._incarnation.get(worker, 0) == incarnation:
                self._absorb_loss(worker, lost)
        except BaseException as exc:  # surfaced to whoever waits next
            self._fail(exc)

    # -- lost workers --------------------------------------------------------------------------

    def _absorb_loss(self, worker: int, lost: WorkerLost) -> None:
        try:
            self.worker_lost(worker, str(lost))
        except BaseException as exc:  # surfaced to whoever waits next
            self._fail(exc)

    def worker_lost(self, worker: int, reason: str) -> None:
        """`worker`'s process is gone, with the requests it ran and their partial output. Each
        is regenerated from scratch on another worker (C1; on the latest version, as any
        restart; its group keeps its dispatch version in the window); a request whose abort
        it never answered is regenerated too; one on its way to it goes elsewhere when its
        partial output arrives (`_queue_resume`); an episode between turns takes its next turn
        elsewhere (its transcript is here). The ledger records each affected group's requeue.
        The runtime then replaces the worker; it gets work again once a weight sync reaches
        it (`published`)."""
        self._incarnation[worker] = self._incarnation.get(worker, 0) + 1
        self.workers_lost += 1
        self.assignment.set_available(worker, False, lost=True)
        self._replacing.add(worker)
        self._resume.pop(worker, None)  # never sent: regenerated below with the rest
        self._abort.pop(worker, None)
        lost = []
        for request_id, request in list(self._requests.items()):
            if request.worker != worker:
                continue
            if request.moving_to is not None:  # counted on its target already
                request.settle_move()
                lost.append((request_id, request))
            elif request.episode is None or not request.episode.stepping:
                lost.append((request_id, request))
        groups = {}
        for request_id, request in lost:
            self._restart(request, request_id, LOST)
            if request.track:
                groups[request.group.group_id] = request
        for group_id, request in groups.items():
            self.ledger.requeue(group_id, f"rollout worker {worker} lost: {reason}")
            self.ledger.start(group_id, request.worker, request.group.dispatch_version)
        self._track(self._replace(worker, reason))

    async def _replace(self, worker: int, reason: str) -> None:
        """Have the runtime start a new process for `worker`; it comes back with the weights
        of the version the runtime last published (if this rollout has not heard of that
        version yet, `published` takes it back)."""
        try:
            version = await self.recovery.replace_worker(worker)
        except CannotReplace:
            self._fail(WorkerLost(worker, "generation", f"{reason}; this runtime cannot "
                                  "replace workers"))
            return
        except BaseException as exc:  # surfaced to whoever waits next
            self._fail(exc)
            return
        if version <= self.assignment.latest:
            self._replacing.discard(worker)
            self.take_back(worker, version)
        else:
            self._replaced[worker] = version

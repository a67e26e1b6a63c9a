"""Streaming rollout: dispatch prompt groups to workers, stream their trajectories into the
experience store, score each as it finishes, and hand the trainer batches the version window
allows. Time-agnostic like the controller: it awaits only the runtime.

Who decides what:
- the version window: how many groups may be in flight, at which version, and which collected
  groups form the next batch (staleness <= K);
- the assignment: which workers may run a request (one version per worker at a time) and
  which running requests migrate so that a legacy version's tail holds as few workers as
  possible; without a router it also picks the worker, one per group;
- the bucket router (Libra, optional): which of those workers runs each request, and, as the
  engine reports length milestones, when a request moves to a worker of a bucket sized for
  what it has left (abort, resume on the target: the same migration path as DORA's);
- the experience store: the rows of every in-flight group; the response and reward columns are
  written by separate producers (the generation stream, the scorer) and a group is collected
  when both are complete for all of its rows;
- the ledger: each group's lifecycle, for the exactly-once proof;
- the episodes (multi-turn, optional): what each turn's end means; between turns the request
  stays counted on its worker (no engine runs it while its environment steps), and it resumes
  from the transcript, with its version (C1), like a migration.

This module dispatches, streams results into the store and hands out batches. Moving requests
between workers (versions published, DORA's consolidation, the router's moves, restarts) is
`core/migration.py`, what happens at an episode's turn ends is `core/episodes.py`: both are
mixins of `StreamingRollout`, which owns all the state.

Generation runs as background tasks, one per (worker, call); a failure in one is re-raised to
whoever waits next, with the worker's name from the runtime's error, except the loss of a
worker's process (`WorkerLost`), which `migration.RolloutMigration.worker_lost` absorbs.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from ..protocol import GenerationRequest, GenerationResult, Group, SamplingParams, Trajectory
from ..errors import WorkerLost
from ..scheduler.buckets import BucketRouter
from .episodes import EpisodeRun, Episodes, EpisodeTurns, NoEpisodes
from .ledger import Ledger
from .migration import NoRecovery, RolloutMigration
from .version_assignment import VersionAssignment
from .rewarding import SafeReward
from .store import ExperienceStore
from .version_window import VersionWindow

TRAINER = "trainer"
NEEDED = ("response", "reward")


@dataclass(slots=True)
class _Request:
    group: Group
    sample: int
    sampling: SamplingParams
    worker: int
    version: int
    track: bool  # training data (store, window, ledger) or evaluation (none of them)
    priority: int = 0  # the group's dispatch order: engines run older groups first
    moving_to: int | None = None  # migration target while its abort is on the way
    episode: EpisodeRun | None = None  # multi-turn: the transcript so far and its environment

    def settle_move(self) -> None:
        """The source's run of a moving request ended (abort, refusal, finish, or its worker
        lost): the assignment's book has had it on the target since the move was decided."""
        self.worker, self.moving_to = self.moving_to, None


@dataclass
class StreamingRollout(EpisodeTurns, RolloutMigration):
    runtime: Any  # runtime.protocol.Runtime
    window: VersionWindow
    assignment: VersionAssignment
    ledger: Ledger
    reward: SafeReward
    decode: Callable[[list[int]], str]
    partial_rollout: bool = False
    migrate: bool = True
    router: BucketRouter | None = None
    # called after each group is collected (streaming refill: the controller tops up)
    on_collect: Callable[[], None] | None = None
    # multi-turn episodes in an environment; NoEpisodes: every request is one turn
    episodes: Episodes | NoEpisodes = field(default_factory=NoEpisodes)
    # replaces lost workers: the runtime when it is `Recoverable` (eddyrl.build), else a
    # stand-in under which a lost worker ends the run
    recovery: Any = field(default_factory=NoRecovery)
    store: ExperienceStore = field(default_factory=ExperienceStore)
    _requests: dict[str, _Request] = field(default_factory=dict)
    _rows: dict[str, list[int]] = field(default_factory=dict)  # group -> its store rows
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _resume: dict[int, list[GenerationRequest]] = field(default_factory=dict)
    _abort: dict[int, list[str]] = field(default_factory=dict)  # router moves, per source
    # request -> workers where an abort arrived after its turn had finished: the engine keeps
    # it and aborts the request's next turn there (only an episode comes back to a worker)
    _stale_aborts: dict[str, set[int]] = field(default_factory=dict)
    _flush_scheduled: bool = False
    _dispatched_groups: Any = field(default_factory=itertools.count)  # priorities, in order
    _failure: BaseException | None = None
    _progress: asyncio.Event | None = None
    _waiters: dict[str, asyncio.Future] = field(default_factory=dict)  # generate_now groups
    _expected: dict[str, int] = field(default_factory=dict)  # generate_now group -> responses
    # per worker: how many times its process was lost (results of a lost incarnation that are
    # still on their way are dropped: their requests were put back already)
    _incarnation: dict[int, int] = field(default_factory=dict)
    _replacing: set[int] = field(default_factory=set)  # lost workers not back yet
    # replaced workers whose version this rollout has not been told of yet (`published`)
    _replaced: dict[int, int] = field(default_factory=dict)
    _parked: list[str] = field(default_factory=list)  # requests waiting for any worker
    workers_lost: int = 0
    regenerated: int = 0  # requests regenerated because their worker was lost
    migrated: int = 0  # requests moved between workers, in all
    restarted: int = 0  # trajectories regenerated because their version's weights were gone
    routed: int = 0  # of `migrated`: moved by the bucket router to another bucket
    # with a router: lengths of the training requests that finished in each bucket since the
    # adaptive scheduler last looked (`take_bucket_lengths`); None until it first looks
    _bucket_lengths: dict[str, list[int]] | None = None

    # -- dispatch ------------------------------------------------------------------------------

    def dispatch(self, groups: list[Group], n: int, sampling: SamplingParams,
                 version: int | None = None, worker: int | None = None) -> None:
        """Admit fresh groups through the window at `version` (default: the latest) and start
        them: each group whole on one worker (the assignment's pick, or `worker`)."""
        per_worker: dict[int, list[GenerationRequest]] = {}
        for group in groups:
            group.dispatch_version = self.window.dispatch(group.group_id, version)
            self._rows[group.group_id] = self.store.add_group(
                group.group_id, n, meta={"group": group})
            target = self._assign(group, n, sampling, True, worker, per_worker)
            self.ledger.start(group.group_id, target, group.dispatch_version)
        self._launch_all(per_worker)

    async def generate_now(self, groups: list[Group], n: int, sampling: SamplingParams,
                           track: bool) -> list[Group]:
        """Generate `n` responses per group on the latest version and wait for them: held-out
        evaluation (untracked) and synchronous refills (tracked in the ledger only)."""
        per_worker: dict[int, list[GenerationRequest]] = {}
        loop = asyncio.get_running_loop()
        for group in groups:
            group.dispatch_version = self.assignment.latest
            self._waiters[group.group_id] = loop.create_future()
            self._expected[group.group_id] = n
            target = self._assign(group, n, sampling, False, None, per_worker, training=track)
            if track:
                self.ledger.start(group.group_id, target, group.dispatch_version)
        self._launch_all(per_worker)
        await self._wait([self._waiters[g.group_id] for g in groups])
        for group in groups:
            del self._waiters[group.group_id], self._expected[group.group_id]
            _sort_samples(group)
            if track:
                self.ledger.collect(group.group_id)
        return groups

    def _assign(self, group: Group, n: int, sampling: SamplingParams, track: bool,
                worker: int | None, per_worker: dict[int, list[GenerationRequest]],
                training: bool = True) -> int:
        """Place the group's `n` requests (on `worker` if given) and queue them per worker;
        returns the first one's worker. Without a router the whole group goes to the
        assignment's pick; with one, each request to the router's choice among the workers
        the assignment allows."""
        version = group.dispatch_version
        priority = next(self._dispatched_groups)
        first = None
        for sample in range(n):
            request_id = f"{group.group_id}-{sample}"
            if self.router is not None:
                allowed = [worker] if worker is not None else self.assignment.eligible(version)
                target = self.router.start(request_id, group.prompt, allowed).instance
            elif first is None:
                target = self.assignment.pick(version) if worker is None else worker
            first = target if first is None else first
            self.assignment.dispatched(target, version)
            self._requests[request_id] = _Request(
                group, sample, sampling, target, version, track, priority,
                episode=self._new_episode(sampling, training))
            per_worker.setdefault(target, []).append(self._request(
                request_id, group.prompt_ids, sampling, version, priority))
        return first

    def _request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 version: int, priority: int, partial: GenerationResult | None = None
                 ) -> GenerationRequest:
        report_at = tuple(self.router.config.milestones) \
            if self.router is not None and self.router.config.policy == "bucket" else ()
        if partial is None:
            return GenerationRequest(request_id, prompt_ids, sampling, version=version,
                                     report_at=report_at, priority=priority)
        return GenerationRequest(request_id, prompt_ids, sampling, resume_ids=partial.token_ids,
                                 resume_logprobs=partial.logprobs,
                                 resume_versions=partial.versions, version=version,
                                 report_at=report_at, priority=priority)

    def _launch_all(self, per_worker: dict[int, list[GenerationRequest]]) -> None:
        for worker, requests in per_worker.items():
            self._track(self._stream(worker, requests))

    def _track(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- results -------------------------------------------------------------------------------

    async def _stream(self, worker: int, requests: list[GenerationRequest]) -> None:
        incarnation = self._incarnation.get(worker, 0)
        try:
            async for result in self.runtime.generate(worker, requests):
                if self._incarnation.get(worker, 0) != incarnation:
                    return  # the worker was lost meanwhile; its requests run elsewhere now
                self._on_result(worker, result)
        except WorkerLost as lost:
            if self._incarnation.get(worker, 0) == incarnation:
                self._absorb_loss(worker, lost)
        except BaseException as exc:  # surfaced to whoever waits next
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._wake()
        if not isinstance(exc, Exception):
            raise exc

    def _on_result(self, worker: int, result: GenerationResult) -> None:
        request = self._requests[result.request_id]
        if not result.final:
            self._route(result.request_id, request, result)
            return
        moved = request.moving_to is not None
        if moved:
            request.settle_move()
        if result.finish_reason == "refused":
            if moved:  # the move's abort still waits on the source, for whatever runs there
                self._stale_aborts.setdefault(result.request_id, set()).add(worker)
            self._restart(request, result.request_id, "refused")
            return
        if moved:
            if not result.finished:  # aborted for its migration: resume it there
                self.migrated += 1
                self._queue_resume(request, result)
                return
            # else it finished on the source before the abort reached it: done all the same
            # (an episode's next turn may come back there, where that abort still waits)
            if request.episode is not None:
                self._stale_aborts.setdefault(result.request_id, set()).add(worker)
        elif not result.finished:
            if worker in self._stale_aborts.get(result.request_id, ()):
                self._stale_aborts[result.request_id].discard(worker)
                self._queue_resume(request, result)  # an old abort hit a later turn: go on
                return
            raise RuntimeError(f"request {result.request_id} on worker {worker} was aborted "
                               "without a migration asking for it")
        if request.episode is not None:  # the environment answers the turn, off this call
            self._turn_ended(result.request_id, request, result)
            return
        self._finish(request, result, *self.reward(self.decode(result.token_ids),
                                                   request.group.answer))

    def _finish(self, request: _Request, result: GenerationResult, reward: float,
                error: str | None) -> None:
        """A response is complete: free its place, then store it (training) or hand it to
        the waiting evaluation."""
        self.assignment.finished(request.worker, request.version)
        del self._requests[result.request_id]
        self._stale_aborts.pop(result.request_id, None)
        if self.router is not None:  # learn from complete training samples only
            if request.track:
                if self._bucket_lengths is not None:
                    bucket = self.router.placement(result.request_id).bucket
                    self._bucket_lengths.setdefault(bucket, []).append(len(result.token_ids))
                self.router.finish(result.request_id, len(result.token_ids))
            else:
                self.router.cancel(result.request_id)
        group = request.group
        if not request.track:
            group.trajectories.append(Trajectory(result, reward, error))
            if len(group.trajectories) == self._expected[group.group_id]:
                self._waiters[group.group_id].set_result(None)
            return
        row = self._rows[group.group_id][request.sample]
        self.store.put(row, "response", result)  # producer 1: the generation stream
        self.store.put(row, "reward", (reward, error))  # producer 2: the scorer
        if self.store.is_complete(group.group_id, NEEDED):
            self.window.collect(group.group_id)
            self.ledger.collect(group.group_id)
            self._wake()
            if self.on_collect is not None:
                self.on_collect()

    # -- training batches ----------------------------------------------------------------------

    async def next_batch(self) -> list[Group]:
        """The next batch the window allows (waiting for completions as needed), as whole
        groups with their trajectories in sample order, taken out of the store."""
        while True:
            self._raise_failure()
            self._progress_event().clear()
            ids = self.window.take_batch()
            if ids is not None:
                break
            if not self.window.running:
                raise RuntimeError("no training batch can form and nothing is generating: "
                                   f"{self.window.running} running, version "
                                   f"{self.window.version}")
            await self._progress_event().wait()
        groups = []
        for taken in self.store.take_groups(TRAINER, ids, NEEDED):
            group = taken.meta["group"]
            group.trajectories = [Trajectory(result, reward, error) for result, (reward, error)
                                  in zip(taken.columns["response"], taken.columns["reward"])]
            self.store.drop(taken.group_id)
            del self._rows[taken.group_id]
            groups.append(group)
        return groups

    def take_bucket_lengths(self) -> dict[str, list[int]]:
        """Lengths of the training requests finished in each bucket since the last call (the
        first call starts the record)."""
        lengths, self._bucket_lengths = self._bucket_lengths, {}
        return lengths or {}

    # -- waiting -------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Let every generation still running finish (collected, never trained)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._raise_failure()

    async def _wait(self, futures: list[asyncio.Future]) -> None:
        while not all(f.done() for f in futures):
            self._raise_failure()
            self._progress_event().clear()
            pending = [f for f in futures if not f.done()]
            waker = asyncio.ensure_future(self._progress_event().wait())
            await asyncio.wait([*pending, waker], return_when=asyncio.FIRST_COMPLETED)
            waker.cancel()
        self._raise_failure()

    def _progress_event(self) -> asyncio.Event:
        if self._progress is None:
            self._progress = asyncio.Event()
        return self._progress

    def _wake(self) -> None:
        self._progress_event().set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure


def _sort_samples(group: Group) -> None:
    """A fixed order inside each group, whatever the completion order."""
    group.trajectories.sort(key=lambda t: int(t.result.request_id.rsplit("-", 1)[1]))

"""Streaming rollout: dispatch prompt groups to workers, stream their trajectories into the
experience store, score each as it finishes, and hand the trainer batches the version window
allows. Time-agnostic like the controller: it awaits only the runtime.

Who decides what:
- the version window: how many groups may be in flight, at which version, and which collected
  groups form the next batch (staleness <= K);
- the request table (`requests.py`; this rollout creates it and hands it to the others):
  where every request is — one record, one status, one worker, one version; every count
  below is the table's;
- the assignment: which workers may run a request (one version per worker at a time) and
  which running requests migrate so that a legacy version's tail holds as few workers as
  possible;
- the placement (`placement.py`): which of those workers runs each request — the whole group
  on the assignment's pick, or Libra's bucket router per request, which may move a request as
  the engine reports length milestones;
- the experience store: the rows of every in-flight group; the response column is written by
  the generation stream, the reward column by the scorer, a consumer of its own; a group is
  collected when both are complete for all of its rows;
- the ledger: each group's lifecycle, for the exactly-once proof.

This module is the data path (dispatch, results, scoring, batches). Its collaborators each
have one job: `Streams` talks to the workers (calls, aborts, tasks, failures), `Moves` moves
requests between workers (DORA, routing, restarts, lost and lent workers), `Turns` handles an
episode's turn ends. None reaches into another's state; all of them change a request only
through the table's transitions.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ..errors import WorkerLost
from ..protocol import GenerationResult, Group, SamplingParams, Trajectory
from ..runtime_protocol import Recoverable, Runtime
from ..scheduler.buckets import BucketRouter
from .episodes import Episodes, NoEpisodes
from .ledger import Ledger
from .moves import Moves, NoRecovery
from .placement import GroupPlacement, RoutedPlacement
from .requests import Purpose, Request, RequestTable
from .rewarding import SafeReward, Scored
from .store import ExperienceStore
from .streams import Streams
from .turns import Turns
from .version_assignment import VersionAssignment
from .version_window import VersionWindow

TRAINER = "trainer"
NEEDED = ("response", "reward")


@dataclass
class StreamingRollout:
    runtime: Runtime
    window: VersionWindow
    assignment: VersionAssignment
    ledger: Ledger
    reward: SafeReward  # anything with `async score_parts(text, answer) -> Scored`
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
    recovery: Recoverable | NoRecovery = field(default_factory=NoRecovery)
    store: ExperienceStore = field(default_factory=ExperienceStore)

    def __post_init__(self) -> None:
        self._rows: dict[str, list[int]] = {}  # group -> its store rows
        self._dispatched_groups = itertools.count()  # priorities, in dispatch order
        self._waiters: dict[str, asyncio.Future] = {}  # generate_now groups
        self._expected: dict[str, int] = {}  # generate_now group -> responses
        # with a router: lengths of the training requests that finished in each bucket since
        # the adaptive scheduler last looked (`take_bucket_lengths`); None until it looks
        self._bucket_lengths: dict[str, list[int]] | None = None
        # where every request is: this rollout's, handed to the assignment (its book, C1),
        # the placement, moves and turns
        self.table = RequestTable(self.assignment.num_workers, book=self.assignment)
        self.assignment.follow(self.table)
        self.streams = Streams(self.runtime, self._on_result, self._on_lost)
        self._wire(self.router)

    def _wire(self, router: BucketRouter | None) -> None:
        placement = GroupPlacement(self.assignment) if router is None \
            else RoutedPlacement(self.assignment, router, self.table)
        self.placement = placement
        self.streams.report_at = placement.report_at
        self.moves = Moves(self.runtime, self.assignment, self.table, self.streams, placement,
                           self.episodes, self.ledger, self.recovery,
                           partial_rollout=self.partial_rollout, migrate=self.migrate)
        self.turns = Turns(self.table, self.moves, self.streams, self.episodes, self._complete)

    def use_router(self, router: BucketRouter | None) -> None:
        """Route with `router` (None: no routing) from now on; only before the first request,
        since the placement and moves are built around it."""
        if len(self.table):
            raise RuntimeError("the rollout's router is set before its first request")
        self.router = router
        self._wire(router)

    def use_partial_rollout(self, on: bool) -> None:
        """The adaptive scheduler's plan switched partial rollout (the engines follow it from
        their next weights): results and moves follow it from now on."""
        self.partial_rollout = on
        self.moves.use_partial_rollout(on)

    # -- what others read ----------------------------------------------------------------------

    @property
    def migrated(self) -> int:
        """Requests moved between workers: resumed on a move's target, or an episode's next
        turn sent to another worker."""
        t = self.table
        return t.events["arrive:resumed"] + t.counted("move_between_turns") + \
            t.events["resume:moved"] + t.counted("redirect")

    @property
    def routed(self) -> int:
        """Of `migrated`: moved by the bucket router to another bucket."""
        return self.table.events["move:routed"] + \
            self.table.events["move_between_turns:tool_state"]

    @property
    def restarted(self) -> int:
        """Trajectories regenerated because their version's weights were gone."""
        return self.table.counted("restart", but=("worker_lost",))

    @property
    def regenerated(self) -> int:
        """Requests regenerated because their worker was lost."""
        return self.table.events["restart:worker_lost"]

    @property
    def stray(self) -> Counter:
        """Results ignored (unknown request, duplicate final, not from the request's worker,
        progress after final, a lost incarnation's), by why."""
        return self.streams.stray

    @property
    def workers_lost(self) -> int:
        return self.moves.workers_lost

    @property
    def num_workers(self) -> int:
        return self.assignment.num_workers

    @property
    def slots_per_worker(self) -> int:
        """Requests one worker decodes together."""
        return self.assignment.slots_per_worker

    @property
    def latest(self) -> int:
        """The newest version the workers were told of (`published`)."""
        return self.assignment.latest

    def serving(self) -> list[bool]:
        """Per worker: whether it takes rollout work now (not lent to training, not lost)."""
        return list(self.assignment.available)

    def legacy_room(self) -> list[tuple[int, int, int]]:
        """(worker, legacy version, free request slots): where DORA's opportunistic fill may
        add new prompts of that version."""
        return self.assignment.legacy_room()

    # -- moves and workers (the controller's and the drivers' calls) ---------------------------

    def published(self, version: int, hosted: list[int]) -> None:
        self.moves.published(version, hosted)

    def holding(self) -> list[int]:
        return self.moves.holding()

    async def rebalance(self, new_requests: int) -> int:
        return await self.moves.rebalance(new_requests)

    async def lend(self, worker: int) -> int:
        return await self.moves.lend(worker)

    def running_on(self, worker: int) -> int:
        return self.moves.running_on(worker)

    def take_back(self, worker: int, hosted_version: int) -> None:
        self.moves.take_back(worker, hosted_version)

    def worker_lost(self, worker: int, reason: str) -> None:
        self.moves.worker_lost(worker, reason)

    # -- dispatch ------------------------------------------------------------------------------

    def dispatch(self, groups: list[Group], n: int, sampling: SamplingParams,
                 version: int | None = None, worker: int | None = None) -> None:
        """Admit fresh groups through the window at `version` (default: the latest) and start
        them where the placement puts them (on `worker` if given)."""
        for group in groups:
            group.dispatch_version = self.window.dispatch(group.group_id, version)
            self._rows[group.group_id] = self.store.add_group(
                group.group_id, n, meta={"group": group})
            target = self._add(group, n, sampling, Purpose.TRAIN, worker)
            self.ledger.start(group.group_id, target, group.dispatch_version)
        self.streams.flush_sends()

    async def generate_now(self, groups: list[Group], n: int, sampling: SamplingParams,
                           purpose: Purpose) -> list[Group]:
        """Generate `n` responses per group on the latest version and wait for them, outside
        the store and the window: held-out evaluation (`EVAL`, in no ledger) and synchronous
        refills (`REFILL`, in the ledger)."""
        if purpose.stored:
            raise ValueError(f"generate_now is for refills and evaluation, not {purpose}: "
                             "training groups are dispatched")
        loop = asyncio.get_running_loop()
        for group in groups:
            group.dispatch_version = self.assignment.latest
            self._waiters[group.group_id] = loop.create_future()
            self._expected[group.group_id] = n
            target = self._add(group, n, sampling, purpose, None)
            if purpose.in_ledger:
                self.ledger.start(group.group_id, target, group.dispatch_version)
        self.streams.flush_sends()
        await self.streams.wait([self._waiters[g.group_id] for g in groups])
        for group in groups:
            del self._waiters[group.group_id], self._expected[group.group_id]
            self.table.forget([f"{group.group_id}-{i}" for i in range(n)])
            _sort_samples(group)
            if purpose.in_ledger:
                self.ledger.collect(group.group_id)
        return groups

    def _add(self, group: Group, n: int, sampling: SamplingParams, purpose: Purpose,
             worker: int | None) -> int | None:
        """Add the group's `n` requests to the table where the placement puts them (parked
        when no worker can take them now) and batch them per worker; returns the first one's
        worker."""
        version = group.dispatch_version
        priority = next(self._dispatched_groups)
        first = None
        for sample in range(n):
            request_id = f"{group.group_id}-{sample}"
            target = self.placement.place(request_id, group.prompt, version, worker, first)
            first = target if sample == 0 else first
            request = self.table.add(Request(
                request_id, group, sample, sampling, purpose, priority,
                episode=self.episodes.start(sampling.max_new_tokens,
                                            training=purpose is not Purpose.EVAL)),
                target, version)
            if target is not None:
                self.streams.send(request)
        return first

    # -- results -------------------------------------------------------------------------------

    def _on_lost(self, worker: int, lost: WorkerLost) -> None:
        self.moves.worker_lost(worker, lost)

    def _on_result(self, worker: int, result: GenerationResult) -> None:
        request = self.table.get(result.request_id)
        if request is None:
            self._stray(worker, result, "duplicate_final" if self.table.is_done(
                result.request_id) else "unknown_request")
            return
        if not request.runs_on(worker):
            self._stray(worker, result, "progress_after_final" if request.worker is None or
                        request.worker == worker else "not_its_worker")
            return
        if result.versions and not self.partial_rollout and \
                result.versions[-1] != request.version:
            # the engine's truth: the book guessed which weights a queued request started on
            self.table.relabel(request.id, result.versions[-1])
        if not result.final:
            self.moves.route(request, result)
            return
        moving = request.source is not None
        if result.finish_reason == "refused":
            if moving:  # the move's abort still waits on the source, for whatever runs there
                self.table.arrive(request.id, resumed=False)
                request.stale_aborts.add(worker)
            self.moves.restart(request, "refused")
            return
        if moving:
            if not result.finished:  # aborted for its migration: resume it there
                self.table.arrive(request.id, resumed=True)
                self.moves.resume(request, result)
                return
            # else it finished on the source before the abort reached it: done all the same
            # (an episode's next turn may come back there, where that abort still waits)
            self.table.arrive(request.id, resumed=False)
            if request.episode is not None:
                request.stale_aborts.add(worker)
        elif not result.finished:
            if worker in request.stale_aborts:
                request.stale_aborts.discard(worker)
                self.moves.resume(request, result)  # an old abort hit a later turn: go on
                return
            raise RuntimeError(f"request {result.request_id} on worker {worker} was aborted "
                               "without a migration asking for it")
        if request.episode is not None:  # the environment answers the turn, off this call
            self.turns.turn_ended(request, result)
            return
        self._complete(request, result, None)

    def _stray(self, worker: int, result: GenerationResult, why: str) -> None:
        self.streams.stray_result(worker, result, why)

    def _complete(self, request: Request, result: GenerationResult,
                  reward: float | None) -> None:
        """A response is complete: free its place at once, store the response (producer 1),
        and score it off this call (producer 2, unless its environment gave the reward)."""
        learn = request.purpose is Purpose.TRAIN  # the router learns from dispatched groups
        bucket = self.placement.finished(request.id, len(result.token_ids), learn)
        if bucket is not None and learn and self._bucket_lengths is not None:
            self._bucket_lengths.setdefault(bucket, []).append(len(result.token_ids))
        self.table.score(request.id)
        if request.purpose.stored:
            self.store.put(self._rows[request.group.group_id][request.sample], "response",
                           result)
        self.streams.start_task(self.streams.guarded(self._score(request, result, reward)))

    async def _score(self, request: Request, result: GenerationResult,
                     reward: float | None) -> None:
        """Store the reward, then hand the group to the window once complete (training) or
        to the waiting evaluation."""
        group = request.group
        if reward is None:
            scored = await self.reward.score_parts(self.decode(result.token_ids), group.answer)
        else:
            scored = Scored(reward, None, None)
        self.table.finish(request.id)
        if not request.purpose.stored:  # a refill or an evaluation: its caller waits
            group.trajectories.append(Trajectory(result, *scored))
            if len(group.trajectories) == self._expected[group.group_id]:
                self._waiters[group.group_id].set_result(None)
            return
        self.store.put(self._rows[group.group_id][request.sample], "reward", scored)
        if self.store.is_complete(group.group_id, NEEDED):
            self.window.collect(group.group_id)
            self.ledger.collect(group.group_id)
            self.streams.wake()
            if self.on_collect is not None:
                self.on_collect()

    # -- training batches ----------------------------------------------------------------------

    async def next_batch(self, count: int | None = None) -> list[Group]:
        """The next batch the window allows (waiting for completions as needed), or the next
        `count` groups of it (a streamed step's part), as whole groups with their
        trajectories in sample order, taken out of the store."""
        while True:
            self.streams.raise_failure()
            self.streams.progress().clear()
            ids = self.window.take_batch(count)
            if ids is not None:
                break
            if not self.window.running:
                raise RuntimeError("no training batch can form and nothing is generating: "
                                   f"{self.window.running} running, version "
                                   f"{self.window.version}")
            await self.streams.progress().wait()
        groups = []
        for taken in self.store.take_groups(TRAINER, ids, NEEDED):
            group = taken.meta["group"]
            group.trajectories = [Trajectory(result, *scored) for result, scored
                                  in zip(taken.columns["response"], taken.columns["reward"])]
            self.store.drop(taken.group_id)
            self.table.forget([f"{taken.group_id}-{i}" for i in range(len(taken.rows))])
            del self._rows[taken.group_id]
            groups.append(group)
        return groups

    def take_bucket_lengths(self) -> dict[str, list[int]]:
        """Lengths of the training requests finished in each bucket since the last call (the
        first call starts the record)."""
        lengths, self._bucket_lengths = self._bucket_lengths, {}
        return lengths or {}

    async def drain(self) -> None:
        """Let every generation still running finish (collected, never trained)."""
        await self.streams.drain()


def _sort_samples(group: Group) -> None:
    """A fixed order inside each group, whatever the completion order."""
    group.trajectories.sort(key=lambda t: int(t.result.request_id.rsplit("-", 1)[1]))

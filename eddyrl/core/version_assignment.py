"""Which rollout worker hosts which policy version: DORA's assignment, as a sans-IO object.

Each worker generates with one version at a time (C1). After a train step every worker has the
new weights staged, but a worker still running requests of an older (legacy) version keeps
hosting it until those finish. The assignment keeps the split of workers between versions
proportional to the work each version has left (DORA: version w gets round(N · R_w / ΣR)
workers, R_w its pending requests), so a few long-tail trajectories of an old version do not
hold many workers back from the new one:

- `plan` consolidates a legacy version hosted by more workers than its share: the hosts with
  the fewest of its requests are evacuated, their requests migrate to the hosts that keep it
  (same version on both ends, so C1 holds; the hf engine re-prefills, an engine that can move
  its KV cache need not). An evacuated worker then takes new prompts on the latest version.
- `pick` routes new requests: latest-version requests to the least-loaded worker that hosts
  the latest version or can switch to it at once, legacy requests to a host of their version.
- `legacy_room` lists legacy hosts with free slots, which DORA fills opportunistically with
  new prompts of that version (the version window decides whether the deadline allows it).
- Multi-turn episodes between turns (the table's `pause` .. `resume`: their environment works)
  stay counted on their worker as their version's live work (DORA retires a version only when
  all its trajectories are collected), but the engine does not see them: once its running
  requests drain it takes newer weights as soon as a newer request arrives. So `pick` sends
  new-version requests to a worker whose legacy weights such episodes wait for only when no
  other worker is available, and the book follows the engine: a worker switches when its
  running legacy requests drain, and episodes stranded on it move to another host of their
  version (`plan`, or the rollout at their next turn) or, when none is left, start over.

The rollout tells it what happens (`moves.py`: weights published, KV use observed, a worker
lent, lost or back) and the request table asks and tells it as requests change (`check_place`,
`worker_changed`); nothing here waits, so the runtime and the simulator drive the same object.
The worker side of the contract: an engine never leaves the version it hosts on its own; it
switches to staged weights only when a request for a newer version arrives (after its running
requests drain), and such a request runs on the newest weights staged by the time it starts,
which `published` mirrors.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass

from ..validation import check_range
from .requests import RequestTable, Status


KV_FILL = 0.75  # the KV-cache fill a consolidated legacy version may reach on its keepers


@dataclass(frozen=True, slots=True)
class Migration:
    """Move `count` running requests of `version` from worker `source` to worker `target`."""

    source: int
    target: int
    version: int
    count: int


class VersionAssignment:
    def __init__(self, num_workers: int, slots_per_worker: int) -> None:
        check_range("num_workers", num_workers, 1)
        check_range("slots_per_worker", slots_per_worker, 1)
        self.num_workers = num_workers
        self.slots_per_worker = slots_per_worker
        self.latest = 0
        self.hosted = [0] * num_workers  # version each worker's loaded weights carry
        self.available = [True] * num_workers  # False: lent to training (elastic pool)
        self.kv_usage = [0.0] * num_workers  # KV cache in use, fraction (last report)
        self._requests: RequestTable | None = None  # the rollout's (`follow`)

    def follow(self, table: RequestTable) -> None:
        """Read where every request is from `table`, which the rollout owns and which has
        this assignment as its book (its counts are the table's, kept by it alone)."""
        if table.num_workers != self.num_workers:
            raise ValueError(f"a table of {table.num_workers} workers for an assignment of "
                             f"{self.num_workers}")
        self._requests = table

    @property
    def requests(self) -> RequestTable:
        if self._requests is None:
            raise RuntimeError("the version assignment follows no request table yet "
                               "(`follow`: the rollout hands it its table)")
        return self._requests

    @property
    def pending(self) -> list[Counter[int]]:
        """Per worker: requests counted there, by version (the request table's)."""
        return self.requests.pending

    @property
    def between_turns(self) -> list[Counter[int]]:
        """Of `pending`: episodes between turns (their engine does not run them now)."""
        return self.requests.between_turns

    @property
    def migrations(self) -> int:
        """Requests moved between workers (moves decided, redirects included)."""
        table = self.requests
        return table.counted("move") + table.counted("move_between_turns") + \
            table.counted("redirect") + table.events["resume:moved"]

    # -- the request table's book (C1) -------------------------------------------------------

    def check_place(self, worker: int, version: int, how: str) -> None:
        """C1 before a request enters `worker`: placed (new, restarted, resumed in place) only
        where the worker hosts its version or can switch to it (the latest); moved only where
        it runs at once (`can_run_now`)."""
        if how == "move":
            if not self.can_run_now(worker, version):
                raise ValueError(f"cannot move version {version} requests to worker {worker}: "
                                 f"it hosts version {self.hosted[worker]} (C1)")
        elif version != self.hosted[worker] and version != self.latest:
            raise ValueError(f"worker {worker} hosts version {self.hosted[worker]} and can "
                             f"switch only to {self.latest}; it cannot generate version "
                             f"{version} (C1)")

    def worker_changed(self, worker: int) -> None:
        """The engine's rule, mirrored: a worker with latest-version work queued and no legacy
        request left running switches to the latest weights (an idle one as the request
        arrives, a busy one once its legacy requests drain)."""
        if self.latest in self.pending[worker] and not self._legacy_running(worker):
            self.hosted[worker] = self.latest

    # -- what the controller reports ---------------------------------------------------------

    def published(self, version: int, hosted: list[int], *, adopt: bool = False) -> None:
        """A new version was staged on every worker; `hosted` is what each one now runs (an
        idle worker applies new weights at once, a busy one keeps its version). Requests
        queued for an older staged version start on this one (the engine applies the newest
        staged weights): they are relabelled — those that have generated nothing yet, were
        waiting for their worker to drain an older version, and whose worker does not report
        their version now (it took the newest weights as the request started, or is still
        draining). A request with generated tokens keeps its version (C1). The book can be a
        moment behind the engine (a result on its way); the rollout corrects a request's
        version from the versions its result's tokens carry. `adopt` (partial rollout): running
        requests go on with the new weights, so every request is the latest version's."""
        if len(hosted) != self.num_workers:
            raise ValueError(f"expected {self.num_workers} worker versions, got {len(hosted)}")
        before, self.latest, self.hosted = self.hosted, version, list(hosted)
        for request in self.requests:
            if request.worker is None or request.version >= version:
                continue
            worker = request.worker
            if adopt or (request.status is Status.RUNNING and not request.resumed
                         and before[worker] < request.version
                         and self.hosted[worker] != request.version):
                self.requests.relabel(request.id, version)

    def observed_kv(self, usage: list[float]) -> None:
        """Each worker's KV-cache use as its engine reports it (a fraction of its cache): a
        legacy version is not consolidated onto fewer workers than its caches fill."""
        if len(usage) != self.num_workers:
            raise ValueError(f"expected {self.num_workers} KV usages, got {len(usage)}")
        self.kv_usage = [float(u) for u in usage]

    def take_back(self, worker: int, hosted_version: int) -> None:
        """`worker` is a rollout worker again (back from training, or replaced), with the
        weights of `hosted_version` loaded."""
        self.hosted[worker] = hosted_version
        self.set_available(worker, True)

    def set_available(self, worker: int, available: bool, *, lost: bool = False) -> None:
        """Lend a worker to training (no new requests; `plan` evacuates its running ones) or
        take it back; `lost`: its process died (even the last worker goes, until replaced)."""
        if not available and not lost and sum(self.available) == 1 and self.available[worker]:
            raise ValueError(f"worker {worker} is the last rollout worker; it cannot leave")
        self.available[worker] = available

    # -- decisions ---------------------------------------------------------------------------

    def targets(self, new_requests: int = 0) -> dict[int, int]:
        """Workers each version should have: proportional to its pending requests (the latest
        version counting `new_requests` about to be dispatched); every version with work keeps
        at least one worker, legacy versions first (their requests cannot go anywhere else)."""
        work: Counter[int] = Counter()
        for pending in self.pending:
            work.update(pending)
        work[self.latest] += new_requests
        total = sum(work.values()) or 1
        workers = sum(self.available)
        legacy = sorted(v for v, n in work.items() if n > 0 and v < self.latest)
        targets = {v: max(1, round(workers * work[v] / total), self._cache_workers(v))
                   for v in legacy}
        # a worker for the latest version only when it has work: else the legacy tails keep
        # every worker (evacuating one for nothing re-prefills its requests elsewhere)
        keep_for_latest = 1 if workers > len(legacy) and work[self.latest] > 0 else 0
        while sum(targets.values()) > workers - keep_for_latest:
            widest = max(targets, key=lambda v: (targets[v], v))
            if targets[widest] == 1:
                break
            targets[widest] -= 1
        targets[self.latest] = max(0, workers - sum(targets.values()))
        return targets

    def plan(self, new_requests: int = 0) -> list[Migration]:
        """Migrations that bring each legacy version down to its share of workers (the hosts
        with the most of its requests keep it; the others' requests are spread over those,
        least loaded first, counting the moves already planned), and that evacuate workers
        lent to training, where another worker hosts the version of their requests (else
        those finish where they are). Requests counted on a worker that no longer hosts their
        version (episodes between turns whose worker took new weights) go to a worker that
        does, if one is left (else they start over at their next turn)."""
        targets = self.targets(new_requests)
        load = [sum(pending.values()) for pending in self.pending]  # as planned so far
        moves: list[Migration] = []
        for version in sorted({v for pending in self.pending for v in pending}):
            hosts = sorted((w for w in range(self.num_workers) if self.pending[w][version]),
                           key=lambda w: (not self.available[w], -self.pending[w][version], w))
            receivers = [w for w in range(self.num_workers)
                         if self.available[w] and self.hosted[w] == version]
            if version == self.latest:
                keep = receivers  # the new version only leaves workers lent to training
            else:
                # Only workers that host the version now can take its requests: one whose book
                # still shows some (results on their way) may already run newer weights.
                keep = [w for w in hosts if w in receivers][:max(1, targets.get(version, 1))] \
                    or sorted(receivers, key=lambda w: (load[w], w))[:1]
            for source in hosts:
                # new-version requests queued behind a legacy tail stay: they start there soon
                staying = version == self.latest and self.available[source]
                if source in keep or staying or not keep:
                    continue
                load[source] -= self.pending[source][version]
                for target, count in _spread(self.pending[source][version], keep, load):
                    moves.append(Migration(source, target, version, count))
        return moves

    def can_run_now(self, worker: int, version: int) -> bool:
        """Whether a request of `version` sent to `worker` now starts without waiting for a
        legacy tail: the worker hosts that version, or it is the latest one and the worker has
        no older request left (it switches as the request arrives), not even an episode
        between turns that needs its weights."""
        return self.available[worker] and (
            self.hosted[worker] == version
            or (version == self.latest and not self._legacy_running(worker)
                and not self._legacy_waiting(worker)))

    def hosts_now(self, version: int) -> list[int]:
        """Workers that can run a request of `version` now (`can_run_now`)."""
        return [w for w in range(self.num_workers) if self.can_run_now(w, version)]

    def eligible(self, version: int) -> list[int]:
        """Workers a request of `version` may be sent to, soonest first: those that can run it
        now; for the latest version, if none can, every available worker (it waits there
        for the legacy tail to drain, then the worker switches)."""
        now = self.hosts_now(version)
        if now or version != self.latest:
            if not now:
                raise ValueError(f"no worker hosts version {version} (hosted: {self.hosted})")
            return now
        return [w for w in range(self.num_workers) if self.available[w]]

    def pick(self, version: int) -> int:
        """The worker for the next request of `version` that will start it soonest, by queue
        length counted in requests: a worker that can run it now has its own queue; one still
        draining a legacy tail counts a full batch on top (the tail goes first, then it switches).
        A latest-version request so goes to a host of that version until that host's queue is
        a batch longer than a draining worker's, instead of piling on the only host; and to a
        worker whose legacy weights episodes between turns wait for only if there is no other
        (it would switch, and they would have to move or start over)."""
        if version != self.latest:
            candidates = self.eligible(version)
        else:
            candidates = [w for w in range(self.num_workers) if self.available[w]]
            free = [w for w in candidates if not self._legacy_waiting(w)]
            candidates = free or candidates
        pending = self.pending  # read once: a property of the request table, and this is
        # asked for every worker on every dispatch (the simulator's hot path at scale)
        return min(candidates, key=lambda w: (
            sum(pending[w].values())
            + (0 if self.can_run_now(w, version) else self.slots_per_worker), w))

    def legacy_room(self) -> list[tuple[int, int, int]]:
        """(worker, version, free request slots) for workers that host a legacy version, have
        requests of it running, and have room for more."""
        room = []
        for worker in range(self.num_workers):
            version = self.hosted[worker]
            busy = sum(self.pending[worker].values())
            if self.available[worker] and version < self.latest and \
                    self.pending[worker][version] and self.latest not in self.pending[worker] \
                    and busy < self.slots_per_worker:
                room.append((worker, version, self.slots_per_worker - busy))
        return room

    def _cache_workers(self, version: int) -> int:
        """Workers whose KV caches the running requests of `version` need, filled to KV_FILL
        (its long tails keep growing: packing them fuller makes the engines preempt and
        recompute them, which DORA's KV-pressure trigger exists to avoid)."""
        used = sum(self.kv_usage[w] for w in range(self.num_workers)
                   if self.hosted[w] == version and self.pending[w][version])
        return math.ceil(used / KV_FILL - 1e-9)

    def _legacy_running(self, worker: int) -> int:
        """Legacy requests the worker's engine runs or queues: it keeps its weights until they
        drain (episodes between turns do not hold it: the engine does not see them)."""
        return sum(n - self.between_turns[worker][v]
                   for v, n in self.pending[worker].items() if v < self.latest)

    def _legacy_waiting(self, worker: int) -> int:
        """Episodes between turns whose next turn needs the worker's (legacy) weights."""
        version = self.hosted[worker]
        return self.between_turns[worker][version] if version < self.latest else 0


def _spread(count: int, workers: list[int], load: list[int]) -> list[tuple[int, int]]:
    """Split `count` requests over `workers` so that their loads end as even as possible
    (water-filling, least loaded first); updates `load`. Returns (worker, count) pairs."""
    heap = [(load[w], w) for w in workers]
    heapq.heapify(heap)
    shares: dict[int, int] = {}
    for _ in range(count):
        current, worker = heapq.heappop(heap)
        shares[worker] = shares.get(worker, 0) + 1
        heapq.heappush(heap, (current + 1, worker))
    for worker, share in shares.items():
        load[worker] += share
    return sorted(shares.items())

"""DORA's assignment: proportional worker shares, consolidation of legacy versions by
migration, routing of new requests, opportunistic legacy fill, and C1 refusals."""

import itertools
import random

import pytest

from eddyrl.core.requests import Purpose, Request, RequestTable, Status
from eddyrl.core.version_assignment import Migration, VersionAssignment


class Book(VersionAssignment):
    """The assignment, with its request table driven by counts as these tests speak of them:
    each call makes the table's transitions for that many anonymous requests (the table keeps
    the counts; nothing here touches them)."""

    _ids = itertools.count()

    def __init__(self, num_workers, slots_per_worker):
        super().__init__(num_workers, slots_per_worker)
        self.follow(RequestTable(num_workers, book=self))  # as the rollout hands it one

    def _some(self, worker, version, count, status):
        ids = [r.id for r in self.requests.counted_on(worker)
               if r.version == version and r.status is status][:count]
        if len(ids) < count:
            running = sum(1 for r in self.requests.counted_on(worker) if r.version == version)
            between = self.between_turns[worker][version]
            if status is Status.RUNNING and between:
                raise ValueError(f"worker {worker}: {between} of its version {version} "
                                 "requests are between turns; resume them before they finish")
            raise ValueError(f"worker {worker} has {running} running requests of version "
                             f"{version}, not {count}")
        return ids

    def dispatched(self, worker, version, count=1):
        for _ in range(count):
            self.requests.add(Request(f"r{next(self._ids)}", None, 0, None, Purpose.TRAIN, 0),
                              worker, version)

    def finished(self, worker, version, count=1):
        for rid in self._some(worker, version, count, Status.RUNNING):
            self.requests.score(rid)
            self.requests.finish(rid)

    def moved(self, source, target, version, count=1, *, between_turns=False):
        status = Status.BETWEEN_TURNS if between_turns else Status.RUNNING
        for rid in self._some(source, version, count, status):
            if between_turns:
                self.requests.move_between_turns(rid, target, "test")
            else:
                self.requests.move(rid, target, "test")
                self.requests.arrive(rid, resumed=True)

    def paused(self, worker, version, count=1):
        for rid in self._some(worker, version, count, Status.RUNNING):
            self.requests.pause(rid)

    def resumed(self, worker, version, count=1):
        for rid in self._some(worker, version, count, Status.BETWEEN_TURNS):
            self.requests.resume(rid, worker)


def _after_step(orch, version, hosted):
    orch.published(version, hosted)
    return orch


def test_all_workers_on_one_version_without_legacy_work():
    orch = Book(num_workers=4, slots_per_worker=64)
    assert orch.targets(new_requests=32) == {0: 4}
    assert orch.plan(32) == []
    picks = []
    for _ in range(8):
        worker = orch.pick(0)
        orch.dispatched(worker, 0, 4)
        picks.append(worker)
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]  # least loaded first: even spread


def test_targets_are_proportional_to_pending_requests_with_one_each_at_least():
    orch = Book(num_workers=8, slots_per_worker=64)
    for w in range(8):
        orch.dispatched(w, 0, 10)
    orch.published(1, [0] * 8)  # every worker still busy with version 0
    # 80 legacy requests vs 240 new: 8 * 80 / 320 = 2 workers stay on version 0
    assert orch.targets(new_requests=240) == {0: 2, 1: 6}
    # a trickle of legacy work still keeps one worker
    for w in range(8):
        orch.finished(w, 0, 9)
    assert orch.targets(new_requests=1000) == {0: 1, 1: 7}


def test_plan_consolidates_a_legacy_tail_onto_its_busiest_hosts():
    orch = Book(num_workers=4, slots_per_worker=64)
    for worker, count in enumerate([1, 5, 2, 1]):
        orch.dispatched(worker, 0, count)
    orch.published(1, [0, 0, 0, 0])
    moves = orch.plan(new_requests=100)
    # 9 legacy requests of 109: one worker keeps version 0 (worker 1, the busiest)
    assert sorted(moves, key=lambda m: m.source) == [
        Migration(0, 1, 0, 1), Migration(2, 1, 0, 2), Migration(3, 1, 0, 1)]
    for move in moves:
        orch.moved(move.source, move.target, move.version, move.count)
    assert orch.pending[1][0] == 9 and orch.migrations == 4
    # evacuated workers are free for the new version; the legacy host is picked last
    picks = set()
    for _ in range(3):
        worker = orch.pick(1)
        orch.dispatched(worker, 1, 10)
        picks.add(worker)
    assert picks == {0, 2, 3} and orch.hosted == [1, 0, 1, 1]


def test_a_busy_worker_switches_only_after_its_legacy_requests_finish():
    orch = Book(num_workers=1, slots_per_worker=8)
    orch.dispatched(0, 0, 2)
    orch.published(1, [0])
    orch.dispatched(0, 1, 4)  # queued behind the running version-0 requests
    assert orch.hosted == [0]
    orch.finished(0, 0, 2)
    assert orch.hosted == [1]


def test_requests_queued_for_a_superseded_version_run_on_the_newest():
    orch = Book(num_workers=1, slots_per_worker=8)
    orch.dispatched(0, 0, 2)
    orch.published(1, [0])
    orch.dispatched(0, 1, 3)  # waiting for version 0 to drain
    orch.published(2, [0])  # version 1 never got to run: 2 replaced it in staging
    assert dict(orch.pending[0]) == {0: 2, 2: 3}


def test_c1_refusals_name_the_worker_and_versions():
    orch = Book(num_workers=2, slots_per_worker=8)
    orch.dispatched(0, 0)
    orch.published(2, [0, 2])
    with pytest.raises(ValueError, match="worker 1 hosts version 2.*cannot generate version 0"):
        orch.dispatched(1, 0)
    with pytest.raises(ValueError, match="worker 1: it hosts version 2"):
        orch.moved(0, 1, 0)
    with pytest.raises(ValueError, match="no worker hosts version 1"):
        orch.pick(1)
    with pytest.raises(ValueError, match="has 0 running"):
        orch.finished(1, 2)


def test_legacy_room_lists_busy_legacy_hosts_with_free_slots():
    orch = Book(num_workers=3, slots_per_worker=8)
    orch.dispatched(0, 0, 3)
    orch.dispatched(1, 0, 8)
    orch.published(1, [0, 0, 1])
    assert orch.legacy_room() == [(0, 0, 5)]  # worker 1 is full, worker 2 on the latest
    orch.dispatched(0, 1, 1)  # new-version work queued: it is switching, no more legacy fill
    assert orch.legacy_room() == []


@pytest.mark.parametrize("seed", range(4))
def test_randomized_bookkeeping_keeps_one_version_per_worker_at_a_time(seed):
    """Random dispatch / finish / publish / plan+migrate: no request ever runs on a worker that
    hosts another version, pending counts never go negative, every version with running
    requests has a host."""
    rng = random.Random(seed)
    n = 4
    orch = Book(num_workers=n, slots_per_worker=16)
    running: list[tuple[int, int]] = []  # (worker, version) per request
    for _ in range(3000):
        action = rng.random()
        if action < 0.35:
            worker = orch.pick(orch.latest)
            orch.dispatched(worker, orch.latest)
            running.append((worker, orch.latest))
        elif action < 0.7 and running:
            worker, version = running.pop(rng.randrange(len(running)))
            orch.finished(worker, version)
        elif action < 0.8:
            hosted = [orch.hosted[w] if any(rw == w for rw, _ in running) else orch.latest + 1
                      for w in range(n)]
            orch.published(orch.latest + 1, hosted)
            # queued requests (waiting for a newer version) start on the newest weights
            running = [(w, orch.latest if v > orch.hosted[w] else v) for w, v in running]
        else:
            for move in orch.plan(rng.randrange(50)):
                moving = [i for i, r in enumerate(running) if r == (move.source, move.version)]
                for i in moving:
                    orch.moved(move.source, move.target, move.version)
                    running[i] = (move.target, move.version)
        for worker, version in running:
            assert version in (orch.hosted[worker], orch.latest)
            if version < orch.latest:
                assert orch.hosted[worker] == version  # C1: legacy requests on a legacy host
        assert sum(sum(p.values()) for p in orch.pending) == len(running)


def test_a_worker_lent_to_training_is_evacuated_and_gets_no_new_work():
    orch = Book(num_workers=3, slots_per_worker=64)
    orch.dispatched(0, 0, 4)
    orch.dispatched(1, 0, 2)
    orch.dispatched(2, 0, 3)
    orch.published(1, [0, 0, 0])
    orch.set_available(2, False)  # the elastic pool lends worker 2 to training
    # version 1 has no work yet: both serving workers keep version 0, and worker 2's requests
    # are spread over them, least loaded first (worker 1: 2 -> 4, then worker 0: 4 -> 5)
    moves = orch.plan(new_requests=0)
    assert sorted(moves, key=lambda m: m.target) == [Migration(2, 0, 0, 1),
                                                      Migration(2, 1, 0, 2)]
    # with version 1 prompts about to come, one worker is kept for them: worker 1 (the
    # fewest version-0 requests) joins worker 2 in moving to worker 0
    assert sorted(orch.plan(new_requests=16), key=lambda m: m.source) == [
        Migration(1, 0, 0, 2), Migration(2, 0, 0, 3)]
    for move in moves:
        orch.moved(move.source, move.target, move.version, move.count)
    assert sum(orch.pending[2].values()) == 0
    assert orch.pick(1) != 2 and orch.legacy_room() and all(w != 2 for w, _, _ in
                                                             orch.legacy_room())
    orch.set_available(2, True)
    orch.set_available(0, False)
    orch.set_available(2, False)
    with pytest.raises(ValueError, match="last rollout worker"):
        orch.set_available(1, False)


def test_can_run_now_and_eligible_follow_c1_and_the_pool():
    orch = Book(num_workers=3, slots_per_worker=8)
    orch.dispatched(0, 0, 2)  # worker 0 busy with version 0
    orch.published(1, [0, 1, 1])
    assert [orch.can_run_now(w, 0) for w in range(3)] == [True, False, False]
    assert [orch.can_run_now(w, 1) for w in range(3)] == [False, True, True]
    assert orch.eligible(1) == [1, 2]
    orch.set_available(2, False)  # lent to training
    assert orch.eligible(1) == [1]
    orch.dispatched(1, 1, 1)
    orch.published(2, [0, 1, 2])  # worker 1 keeps version 1 for its running request
    # nobody can start version 2 at once except... worker 2 is lent, 0 and 1 have legacy work:
    # the latest version waits on every available worker
    assert orch.eligible(2) == [0, 1]
    with pytest.raises(ValueError, match="no worker hosts version 5"):
        orch.eligible(5)


def test_a_move_to_an_idle_worker_switches_it_to_the_latest_version():
    orch = Book(num_workers=2, slots_per_worker=8)
    orch.published(1, [1, 0])  # worker 1 idle with old weights staged-over: switches on use
    orch.dispatched(0, 1, 1)
    orch.moved(0, 1, 1)
    assert orch.hosted == [1, 1] and orch.pending[1][1] == 1 and orch.migrations == 1


def test_partial_rollout_counts_running_work_as_the_latest_version():
    orch = Book(num_workers=2, slots_per_worker=8)
    orch.dispatched(0, 0, 3)
    # partial rollout: every engine applied version 1 at once
    orch.published(1, [1, 1], adopt=True)
    assert orch.pending[0] == {1: 3}
    orch.moved(0, 1, 1)  # now a move between workers passes the C1 check
    orch.finished(1, 1)
    assert sum(orch.pending[0].values()) == 2


def test_evacuated_requests_are_spread_over_the_keepers_not_dumped_on_one():
    """Three evacuated workers' requests go to the keepers least loaded first, counting the
    moves already planned: without that every source picked the same least-loaded keeper
    (seen in the simulator: one worker left with thousands of queued requests)."""
    orch = Book(num_workers=6, slots_per_worker=8)
    for worker, count in enumerate([30, 30, 10, 10, 10, 0]):
        orch.dispatched(worker, 0, count)
    orch.published(1, [0, 0, 0, 0, 0, 1])
    moves = orch.plan(new_requests=160)  # 6 * 80 / 240: version 0 keeps its 2 largest hosts
    assert {m.target for m in moves} == {0, 1}
    landed = {0: 30, 1: 30}
    for m in moves:
        landed[m.target] += m.count
    assert landed == {0: 45, 1: 45}  # 30 evacuated requests split evenly
    assert sum(m.count for m in moves) == 30


def test_a_legacy_version_keeps_the_workers_its_kv_caches_fill():
    """By request count version 0 (12 requests vs 100 new) would shrink to one worker; its
    caches are 60% full on three workers, so consolidating would overflow the keeper: it keeps
    ceil(1.8 / KV_FILL) = 3 workers and nothing moves. With light caches it consolidates."""
    def assignment(kv):
        orch = Book(num_workers=4, slots_per_worker=64)
        for worker, count in ((0, 10), (1, 1), (2, 1)):
            orch.dispatched(worker, 0, count)
        orch.published(1, [0, 0, 0, 1])
        orch.observed_kv(kv)
        return orch

    assert assignment([0.6, 0.6, 0.6, 0.0]).plan(new_requests=100) == []
    light = assignment([0.1, 0.05, 0.05, 0.0])
    assert light.targets(100)[0] == 1
    assert sorted((m.source, m.target) for m in light.plan(new_requests=100)) == [(1, 0), (2, 0)]
    with pytest.raises(ValueError, match="4 KV usages"):
        light.observed_kv([0.1])


def test_new_prompts_do_not_pile_onto_the_only_worker_hosting_the_new_version():
    """Worker 1 switched to version 1; workers 0 and 2 still drain short version-0 tails. The
    new version's requests go to worker 1 until its queue is a batch (8) longer than a
    draining worker's, then spread over all three (before: all 40 went to worker 1)."""
    orch = Book(num_workers=3, slots_per_worker=8)
    orch.dispatched(0, 0, 2)
    orch.dispatched(2, 0, 2)
    orch.published(1, [0, 1, 0])
    for _ in range(40):
        orch.dispatched(orch.pick(1), 1)
    queued = [orch.pending[w][1] for w in range(3)]
    assert sum(queued) == 40 and max(queued) - min(queued) <= 8 + 2 + 1
    assert queued[1] == max(queued)  # the host of version 1 still takes the most
    assert orch.hosted == [0, 1, 0]  # the others switch once their tails drain (C1)


def test_episodes_between_turns_are_live_work_that_keeps_their_worker_on_its_version():
    """Worker 0 runs one version-0 request and hosts an episode between turns; worker 1 took
    version 1 and is loaded. New-version requests keep off worker 0 (it would switch as soon as
    its running request ends, and the episode would have to start over) unless no other
    worker is available; then the book switches with the engine and the episode is stranded."""
    orch = Book(num_workers=2, slots_per_worker=1)
    orch.dispatched(0, 0, 2)
    orch.paused(0, 0)  # its environment works: the engine does not see it
    orch.published(1, [0, 1])
    orch.dispatched(1, 1, 4)
    assert orch.targets(0) == {0: 1, 1: 1}  # the episode counts as version 0's work
    assert not orch.can_run_now(0, 1) and orch.pick(1) == 1  # by queue length: worker 0
    with pytest.raises(ValueError, match="between turns; resume them"):
        orch.finished(0, 0, 2)
    orch.set_available(1, False)
    assert orch.pick(1) == 0  # nowhere else
    orch.dispatched(0, 1)
    orch.finished(0, 0)  # the running one ends: the engine switches for the new request
    assert orch.hosted[0] == 1 and orch.hosts_now(0) == []  # the episode has no host left
    orch.resumed(0, 0)
    orch.finished(0, 0)  # the rollout starts it over
    assert orch.pending[0] == {1: 1} and orch.between_turns[0] == {}


def test_episodes_stranded_by_a_switch_move_to_a_worker_that_still_hosts_their_version():
    """Worker 0 was idle when version 1 arrived (its episode waited for a tool) and applied it;
    worker 1 still hosts version 0 with nothing of it running. The plan sends the episode
    there, between turns (no abort), and from then on worker 1 is kept for it."""
    orch = Book(num_workers=2, slots_per_worker=8)
    orch.dispatched(0, 0)
    orch.paused(0, 0)
    orch.dispatched(1, 0)
    orch.published(1, [1, 0])
    orch.finished(1, 0)
    assert orch.can_run_now(0, 1)  # a stranded episode does not hold its worker back
    assert orch.plan(new_requests=8) == [Migration(0, 1, 0, 1)]
    orch.moved(0, 1, 0, between_turns=True)
    assert orch.between_turns == [{}, {0: 1}] and orch.pending == [{}, {0: 1}]
    assert orch.pick(1) == 0 and not orch.can_run_now(1, 1)
    orch.published(2, [1, 0])  # relabelling leaves an episode of a hosted version alone
    orch.published(2, [1, 0], adopt=True)  # partial rollout: on with the newest weights
    assert orch.between_turns == [{}, {2: 1}]

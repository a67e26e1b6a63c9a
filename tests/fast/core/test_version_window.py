"""Bounded staleness: the admission formula, the K = 0 synchronous case, requeue, the live-version
window, and a randomized proof that no group is trained more than K versions late."""

import random

import pytest

from eddyrl.core.version_window import StalenessError, VersionWindow, VersionWindowError
from eddyrl.errors import ConfigError


def test_k0_is_synchronous_each_batch_generated_at_the_current_version():
    window = VersionWindow(max_staleness=0, batch_groups=2, max_concurrent=8)
    assert window.capacity() == 2
    assert window.dispatch("a") == 0 and window.dispatch("b") == 0
    assert window.capacity() == 0
    window.collect("a")
    window.collect("b")
    assert window.capacity() == 0, "collected groups still hold this step's slots"
    with pytest.raises(VersionWindowError, match="no capacity"):
        window.dispatch("c")
    assert window.take_batch() == ["a", "b"]
    assert window.advance() == 1
    assert window.capacity() == 2
    assert window.dispatch("c") == 1


def test_a_taken_step_no_longer_counts_as_room_before_the_version_advances():
    """Between taking a batch and advancing, the current step's B slots are used: a group
    dispatched then is due by the next step, which the groups already waiting fill (before
    the fix the window admitted B more, none of which could ever be trained in time)."""
    window = VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=4)
    for group in "abcd":
        window.dispatch(group)
    window.collect("a")
    window.collect("b")
    assert window.take_batch() == ["a", "b"]
    assert window.capacity() == 0  # c, d fill step 1, the last a group of version 0 may use
    window.advance()
    assert window.capacity() == 2


def test_one_batch_in_flight_is_textbook_one_step_off_policy():
    """max_concurrent = B with K = 1: once a batch has finished generating, the next one may
    start (the controller dispatches it when it takes the batch, before training) at the
    trainer's version, and is trained one version later."""
    window = VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=2)
    window.dispatch("a"), window.dispatch("b")
    assert window.capacity() == 0  # one batch generating
    window.collect("a"), window.collect("b")
    assert window.take_batch() == ["a", "b"]
    assert window.capacity() == 2
    window.dispatch("c"), window.dispatch("d")  # generated at version 0 while a, b train
    assert window.capacity() == 0
    window.advance()
    assert window.staleness("c") == window.staleness("d") == 1
    window.collect("c"), window.collect("d")
    assert window.take_batch() == ["c", "d"]


def test_capacity_is_the_areal_formula():
    window = VersionWindow(max_staleness=1, batch_groups=3, max_concurrent=4)
    assert window.capacity() == 4  # min(4 - 0, (1 + 0 + 1) * 3 - 0) = min(4, 6)
    for g in "abcd":
        window.dispatch(g)
    assert window.capacity() == 0  # max_concurrent reached
    window.collect("a")
    window.collect("b")
    assert window.capacity() == 2  # min(4 - 2, 6 - (2 + 2)) = 2
    window.dispatch("e")
    window.dispatch("f")
    assert window.capacity() == 0  # min(4 - 4, 6 - (2 + 4)) = 0
    window.collect("c")
    window.collect("d")
    window.collect("e")
    assert window.capacity() == 0  # min(4 - 1, 6 - (5 + 1)) = 0: the staleness bound binds
    assert window.take_batch() == ["a", "b", "c"]
    window.advance()
    assert window.capacity() == 3  # min(4 - 1, 9 - 6)


def test_dispatch_twice_and_unknown_groups_raise():
    window = VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=4)
    window.dispatch("a")
    with pytest.raises(VersionWindowError, match="already dispatched"):
        window.dispatch("a")
    with pytest.raises(VersionWindowError, match="not running"):
        window.collect("zz")
    window.collect("a")
    with pytest.raises(VersionWindowError, match="not running"):
        window.requeue("a")
    with pytest.raises(VersionWindowError, match="not dispatched"):
        window.staleness("zz")


def test_bad_arguments_name_the_key():
    with pytest.raises(ConfigError, match="max_staleness"):
        VersionWindow(max_staleness=-1, batch_groups=1, max_concurrent=1)
    with pytest.raises(ConfigError, match="batch_groups"):
        VersionWindow(max_staleness=0, batch_groups=0, max_concurrent=1)


def test_requeue_frees_the_slot_and_redispatches_at_the_newer_version():
    window = VersionWindow(max_staleness=1, batch_groups=1, max_concurrent=4)
    window.dispatch("a")
    window.dispatch("b")
    window.collect("a")
    assert window.take_batch() == ["a"]
    window.advance()
    assert window.capacity() == 1
    window.requeue("b")  # its worker died
    assert window.capacity() == 2 and window.running == 0
    assert window.dispatch("b") == 1 and window.staleness("b") == 0


def test_live_versions_retirable_and_staleness():
    window = VersionWindow(max_staleness=2, batch_groups=1, max_concurrent=8)
    window.dispatch("a")
    window.dispatch("b")
    window.collect("b")
    window.advance()
    window.dispatch("c")
    assert window.live_versions() == {0, 1}
    assert window.staleness("a") == 1 and window.staleness("c") == 0
    assert not window.retirable(0) and not window.retirable(1)
    window.collect("a")
    assert window.live_versions() == {1}
    assert window.retirable(0) and not window.retirable(1)


def test_advance_refuses_to_strand_a_running_group_beyond_k():
    # Training in *collection* order lets later groups overtake a slow one; the window refuses
    # to move on rather than let the slow group become K + 1 versions old.
    window = VersionWindow(max_staleness=1, batch_groups=1, max_concurrent=8)
    window.dispatch("slow")
    window.dispatch("h")
    window.collect("h")
    assert window.take_batch() == ["h"]
    window.advance()  # "slow" is now 1 behind: allowed
    window.dispatch("i")
    window.collect("i")
    assert window.take_batch() is None, "slow is due: a batch of [i] would strand it"
    assert not window.can_advance()
    with pytest.raises(StalenessError, match="version 0"):
        window.advance()
    window.collect("slow")
    assert window.can_advance()
    window.advance()
    with pytest.raises(StalenessError, match="2 versions behind"):
        window.check_trainable("slow")


@pytest.mark.parametrize("k,b,max_concurrent,seed,parts", [
    (0, 2, 3, 0, 1), (1, 2, 8, 1, 1), (2, 3, 5, 2, 1), (3, 1, 16, 3, 1), (1, 4, 4, 4, 1),
    (0, 4, 4, 5, 2), (1, 6, 9, 6, 3), (3, 8, 16, 7, 4)])
def test_randomized_staleness_never_exceeds_k(k, b, max_concurrent, seed, parts):
    """Thousands of random dispatch/collect/requeue/train calls; the trainer consumes batches of
    B collected groups in dispatch order (`parts` > 1: in that many parts, a streamed step).
    Every trained group is at most K versions old, at most K + 1 versions are live, and the
    admission bound always holds."""
    rng = random.Random(seed)
    window = VersionWindow(max_staleness=k, batch_groups=b, max_concurrent=max_concurrent)
    ids = iter(range(10**9))
    queued: list[str] = []  # requeued groups wait here to be dispatched again
    trained = 0
    for _ in range(4000):
        running = window.running_groups()
        action = rng.random()
        if action < 0.4 and window.capacity():
            group = queued.pop(0) if queued else f"g{next(ids)}"
            assert window.dispatch(group) == window.version
        elif action < 0.75 and running:
            window.collect(rng.choice(running))
        elif action < 0.8 and running:
            group = rng.choice(running)
            window.requeue(group)
            queued.append(group)
        else:
            batch = window.take_batch(b // parts)
            if batch is not None:
                trained += len(batch)
                if window.taken == b:
                    assert window.can_advance()  # dispatch order never strands a running group
                    window.advance()
        live = window.live_versions()
        assert max(live) - min(live) <= k, live
        assert window.running <= max_concurrent
        assert window.accepted + window.running <= (k + window.version + 1) * b
        for group in running:
            if window.is_running(group):
                assert window.staleness(group) <= k
    assert window.version >= 100 and trained == window.version * b + window.taken


def test_randomized_takes_check_every_group_at_training_time():
    # The same invariant seen from outside: record each group's dispatch version ourselves and
    # check the lag at the moment the trainer takes it.
    rng = random.Random(7)
    window = VersionWindow(max_staleness=2, batch_groups=2, max_concurrent=6)
    born: dict[str, int] = {}
    worst = 0
    for step in range(3000):
        running = window.running_groups()
        if rng.random() < 0.5 and window.capacity():
            born[f"g{step}"] = window.dispatch(f"g{step}")
        elif running and rng.random() < 0.7:
            window.collect(rng.choice(running))
        elif (batch := window.take_batch()) is not None:
            worst = max(worst, *(window.version - born[g] for g in batch))
            window.advance()
    assert 0 < worst <= 2


def test_a_streamed_step_takes_its_batch_in_parts():
    window = VersionWindow(max_staleness=0, batch_groups=4, max_concurrent=4)
    for g in "abcd":
        window.dispatch(g)
    window.collect("b")
    assert window.take_batch() is None, "the whole batch is not collected yet"
    assert window.take_batch(1) == ["b"]  # a part trains while the rest generate
    assert window.taken == 1
    assert window.capacity() == 0, "the taken group's slot is not the next version's yet"
    with pytest.raises(VersionWindowError, match="cannot take 0"):
        window.take_batch(0)
    for g in "acd":
        window.collect(g)
    assert window.take_batch(2) == ["a", "c"]
    assert window.take_batch(1) == ["d"]  # the rest of the version's batch
    window.advance()
    assert window.taken == 0 and window.capacity() == 4


def test_completion_order_lets_fast_groups_overtake_a_slow_one_until_its_deadline():
    window = VersionWindow(max_staleness=2, batch_groups=1, max_concurrent=8)
    for g in ("slow", "b", "c"):
        window.dispatch(g)  # all at version 0: deadline 2
    window.collect("b")
    assert window.take_batch() == ["b"]  # step 0 does not wait for "slow"
    window.advance()
    window.collect("c")
    assert window.take_batch() == ["c"]  # step 1 neither: "slow" can still make step 2
    window.advance()
    window.dispatch("d")  # version 2
    window.collect("d")
    assert window.take_batch() is None, "slow is due now: the trainer must wait for it"
    window.collect("slow")
    assert window.take_batch() == ["slow"]  # the earliest deadline goes first
    assert window.staleness("d") == 0


def test_take_refuses_a_batch_that_would_strand_more_than_the_next_steps_can_train():
    # K = 2, B = 2: at version 0, six groups may be in flight, all due by step 2. If step 0
    # trained two fresh arrivals while four older... here all are the same age, so the check
    # is about counts: after taking 2, 4 remain due by step 2 = 2 steps x 2 groups: fine.
    window = VersionWindow(max_staleness=2, batch_groups=2, max_concurrent=8)
    for g in "abcdef":
        window.dispatch(g)
    window.collect("e")
    window.collect("f")
    assert window.take_batch() == ["e", "f"]
    window.advance()
    window.dispatch("g")
    window.dispatch("h")  # version 1, due by step 3
    window.collect("g")
    window.collect("h")
    # a..d (version 0) are due by step 2: taking g, h now would leave 4 due within 1 step
    assert window.take_batch() is None
    window.collect("a")
    window.collect("b")
    assert window.take_batch() == ["a", "b"]


def test_legacy_capacity_admits_older_versions_only_while_their_deadline_is_ahead():
    window = VersionWindow(max_staleness=3, batch_groups=2, max_concurrent=100)
    for g in "ab":
        window.dispatch(g)
    window.collect("a")
    window.collect("b")
    assert window.take_batch() == ["a", "b"]
    window.advance()  # version 1
    # version 0: deadline 3; ever due by 3 = 2 (a, b) + what we add <= 4 * 2
    assert window.capacity(0) == 6
    assert window.capacity(1) == 8  # (K + 1) * B - untaken
    assert window.capacity(2) == 0, "future versions are not hosted yet"
    for i in range(6):
        assert window.dispatch(f"old{i}", version=0) == 0
    assert window.capacity(0) == 0 and window.capacity(1) == 2
    with pytest.raises(VersionWindowError, match="at version 0"):
        window.dispatch("one-too-many", version=0)
    for _ in range(3):
        window.advance() if window.can_advance() else None
    assert window.capacity(0) == 0  # due now or past: never admitted


def _dispatch_order_take(window_state, b):
    """The reference rule (synchronous training): the B earliest-dispatched groups, once all collected."""
    order, running = window_state
    head = order[:b]
    return None if len(head) < b or any(g in running for g in head) else head


def test_with_k0_a_batch_is_what_was_dispatched_at_this_version():
    rng = random.Random(0)
    window = VersionWindow(max_staleness=0, batch_groups=3, max_concurrent=6)
    order: list[str] = []
    for step in range(3000):
        running = window.running_groups()
        if rng.random() < 0.5 and window.capacity():
            window.dispatch(f"g{step}")
            order.append(f"g{step}")
        elif running and rng.random() < 0.6:
            window.collect(rng.choice(running))
        else:
            expected = _dispatch_order_take((order, set(window.running_groups())), 3)
            assert window.take_batch() == expected
            if expected is not None:
                del order[:3]
                window.advance()
    assert window.version > 100


@pytest.mark.parametrize("k,b,seed", [(2, 2, 0), (3, 1, 1), (3, 4, 2), (5, 3, 3)])
def test_randomized_legacy_dispatch_and_completion_order_keep_c3(k, b, seed):
    """Random dispatches at any admitted version (current or legacy), random completion order:
    every group is taken within K of its version, the trainer is never left without a feasible
    batch once everything is collected, and the window never refuses to advance after a take."""
    rng = random.Random(seed)
    window = VersionWindow(max_staleness=k, batch_groups=b, max_concurrent=(k + 1) * b + 3)
    born: dict[str, int] = {}
    worst = 0
    for step in range(5000):
        running = window.running_groups()
        action = rng.random()
        version = window.version - rng.randrange(k + 1)
        if action < 0.45 and window.capacity(version):
            born[f"g{step}"] = window.dispatch(f"g{step}", version=version)
        elif action < 0.8 and running:
            window.collect(rng.choice(running))
        else:
            batch = window.take_batch()
            if batch is None and not running and len(born) >= b:
                pytest.fail("everything collected, yet no feasible batch")
            if batch is not None:
                worst = max(worst, *(window.version - born.pop(g) for g in batch))
                assert window.can_advance()
                window.advance()
    assert window.version > 200 and worst == k


def test_lowering_k_keeps_the_deadlines_of_groups_already_admitted():
    # K = 2 admits three batches at version 0, all due by step 2; lowering K to 0 must neither
    # drop them nor make them untrainable: they are trained by their own deadline, and new
    # groups are admitted only once the old ones leave room for a K = 0 batch.
    window = VersionWindow(max_staleness=2, batch_groups=1, max_concurrent=8)
    for g in "abc":
        window.dispatch(g)
    window.set_max_staleness(0)
    assert window.capacity() == 0, "the step's one slot is a's, b's or c's"
    assert window.deadline("c") == 2
    for step, g in enumerate("abc"):
        window.collect(g)
        assert window.take_batch() == [g]
        window.advance()
        assert window.capacity() == (1 if step == 2 else 0)
    window.dispatch("d")  # version 3, K = 0: due at once
    assert window.deadline("d") == 3
    window.set_max_staleness(3)
    assert window.deadline("d") == 3, "raising K does not move an admitted group's deadline"
    assert window.capacity() == 3  # (3 + 1) steps x 1 - d


def test_after_lowering_k_the_earliest_deadline_trains_first_whatever_its_k():
    window = VersionWindow(max_staleness=1, batch_groups=1, max_concurrent=8)
    window.dispatch("slow")  # K = 1: due by step 1
    window.set_max_staleness(0)
    window.dispatch("a")  # K = 0: due at step 0, and step 1 still has slow's slot
    assert window.capacity() == 0
    window.collect("slow")
    assert window.take_batch() is None, "a is due now: slow must not go first"
    assert not window.can_advance(), "a would pass its deadline"
    window.collect("a")
    assert window.take_batch() == ["a"]
    window.advance()
    assert window.take_batch() == ["slow"]  # at lag 1, its own bound
    window.advance()
    window.dispatch("b")  # version 2, K = 0
    with pytest.raises(StalenessError, match=r"from version 2 must be trained by version 2 "
                                             r"\(max_staleness = 0 at their dispatch\)"):
        window.advance()


@pytest.mark.parametrize("k_max,b,seed", [(2, 2, 0), (3, 1, 1), (4, 3, 2), (1, 2, 3)])
def test_randomized_k_changes_lose_repeat_and_strand_nothing(k_max, b, seed):
    """K changes at random (the governor) while groups admitted under other Ks are in flight:
    each is trained within the K in force at its dispatch, none twice, none lost; once dispatch
    stops, everything in flight is trained (a lowered K never stalls the trainer)."""
    rng = random.Random(seed)
    window = VersionWindow(max_staleness=k_max, batch_groups=b, max_concurrent=(k_max + 1) * b)
    bound: dict[str, int] = {}  # group -> the K in force at its dispatch
    born: dict[str, int] = {}
    trained: list[str] = []
    lowered_with_old_in_flight = 0
    for step in range(6000):
        running = window.running_groups()
        action = rng.random()
        if action < 0.05:
            new_k = rng.randrange(k_max + 1)
            lowered_with_old_in_flight += new_k < window.max_staleness and bool(born)
            window.set_max_staleness(new_k)
        elif action < 0.45 and window.capacity():
            born[f"g{step}"] = window.dispatch(f"g{step}")
            bound[f"g{step}"] = window.max_staleness
        elif action < 0.8 and running:
            window.collect(rng.choice(running))
        else:
            batch = window.take_batch()
            if batch is None and not running and len(born) >= b:
                pytest.fail("everything collected, yet no feasible batch")
            if batch is not None:
                for g in batch:
                    assert window.version - born.pop(g) <= bound[g], g
                trained += batch
                assert window.can_advance()
                window.advance()
    # drain: no new dispatch; collect everything, then whole batches train what is left
    for g in window.running_groups():
        window.collect(g)
    while len(born) >= b:
        batch = window.take_batch()
        assert batch is not None, f"stalled with {len(born)} collected groups"
        for g in batch:
            assert window.version - born.pop(g) <= bound[g], g
        trained += batch
        window.advance()
    assert len(trained) == len(set(trained)) and window.version > 200
    assert lowered_with_old_in_flight > 20  # the case under test happened

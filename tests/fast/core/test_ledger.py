"""The ledger: legal lifecycles, illegal moves named precisely, the exactly-once proof, counts,
and a checkpoint round trip."""

import json
import random

import pytest

from eddyrl.core.ledger import LEGAL, Event, Ledger, LedgerError, State


def _fresh(ledger, gid, prompt, epoch=0, step=1, worker=0, version=0):
    ledger.queue(gid, prompt, epoch)
    ledger.start(gid, worker, version)
    ledger.collect(gid)
    ledger.train_fresh(gid, step)


def test_full_lifecycle_with_requeue_and_replay_records_every_event():
    ledger = Ledger()
    ledger.queue("g0", prompt_index=5, epoch=0)
    ledger.start("g0", worker=1, version=0)
    ledger.requeue("g0", reason="worker 1 died")
    ledger.step = 1
    ledger.start("g0", worker=2, version=1)
    ledger.collect("g0")
    ledger.train_fresh("g0", step=2)
    ledger.to_replay("g0")
    ledger.replayed("g0", step=3)
    ledger.replayed("g0", step=4)
    ledger.evict("g0", reason="reuse")
    assert ledger.state("g0") is State.EVICTED and ledger.reuses("g0") == 2
    assert ledger.history("g0") == [
        Event(0, State.QUEUED), Event(0, State.GENERATING, 1, 0),
        Event(0, State.QUEUED, reason="worker 1 died"), Event(1, State.GENERATING, 2, 1),
        Event(1, State.COLLECTED, 2, 1), Event(2, State.TRAINED_FRESH, 2, 1),
        Event(2, State.IN_REPLAY, 2, 1), Event(3, State.IN_REPLAY, 2, 1, "replayed"),
        Event(4, State.IN_REPLAY, 2, 1, "replayed"), Event(4, State.EVICTED, 2, 1, "reuse")]


def test_replay_off_goes_straight_to_done_and_dropped_groups_are_evicted():
    ledger = Ledger()
    _fresh(ledger, "a", 0)
    ledger.finish("a")
    ledger.queue("b", 1, 0)
    ledger.start("b", 0, 0)
    ledger.collect("b")
    ledger.evict("b", reason="no signal")
    assert ledger.state("a") is State.DONE and ledger.state("b") is State.EVICTED


@pytest.mark.parametrize("path,bad", [
    ([], "collect"),  # QUEUED -> COLLECTED
    ([], "train_fresh"),  # QUEUED -> TRAINED_FRESH: never trained without generating
    (["start"], "train_fresh"),  # GENERATING -> TRAINED_FRESH
    (["start", "collect"], "requeue"),  # COLLECTED -> QUEUED: a collected group is kept
    (["start", "collect", "train_fresh"], "train_fresh"),  # fresh twice
    (["start", "collect", "train_fresh"], "replayed"),  # replayed before entering replay
    (["start", "collect", "train_fresh", "finish"], "to_replay"),  # DONE is final
    (["start", "collect", "train_fresh", "to_replay"], "to_replay"),  # enters replay once
])
def test_illegal_transitions_raise_naming_group_and_states(path, bad):
    ledger = Ledger()
    ledger.queue("g", 0, 0)
    calls = {"start": lambda: ledger.start("g", 0, 0), "collect": lambda: ledger.collect("g"),
             "train_fresh": lambda: ledger.train_fresh("g", 1),
             "requeue": lambda: ledger.requeue("g", "x"), "finish": lambda: ledger.finish("g"),
             "to_replay": lambda: ledger.to_replay("g"),
             "replayed": lambda: ledger.replayed("g", 1)}
    for name in path:
        calls[name]()
    before, step = ledger.state("g"), ledger.step
    with pytest.raises(LedgerError, match=rf"'g'.*{before.value} -> "):
        calls[bad]()
    assert ledger.state("g") is before and ledger.step == step  # a refusal changes nothing


def test_unknown_and_duplicate_ids_raise():
    ledger = Ledger()
    with pytest.raises(LedgerError, match="'nope' is not in the ledger"):
        ledger.state("nope")
    ledger.queue("g", 0, 0)
    with pytest.raises(LedgerError, match="already in the ledger"):
        ledger.queue("g", 1, 0)


def test_terminal_states_have_no_exits_and_every_state_is_reachable():
    assert not LEGAL[State.DONE] and not LEGAL[State.EVICTED]
    reachable, frontier = {State.QUEUED}, [State.QUEUED]
    while frontier:
        for nxt in LEGAL[frontier.pop()] - reachable:
            reachable.add(nxt)
            frontier.append(nxt)
    assert reachable == set(State)


def test_exactly_once_finds_missing_duplicated_and_dropped():
    ledger = Ledger()
    for prompt in (0, 1, 3):
        _fresh(ledger, f"e0-{prompt}", prompt)
    _fresh(ledger, "e0-1-again", 1)  # e.g. a resume that re-queued prompt 1 under a new id
    ledger.queue("e0-2", 2, 0)  # prompt 2 never got past the queue: lost
    ledger.queue("e0-4", 4, 0)
    ledger.start("e0-4", 0, 0)
    ledger.collect("e0-4")
    ledger.evict("e0-4", "no signal")  # deliberately dropped, recorded
    _fresh(ledger, "e1-2", 2, epoch=1)  # another epoch does not count
    report = ledger.check_exactly_once(range(5), epoch=0)
    assert report.missing == [2] and report.duplicated == [1] and report.dropped == [4]
    assert not report.ok
    assert ledger.fresh_train_counts_by_prompt(0) == {0: 1, 1: 2, 2: 0, 3: 1, 4: 0}
    assert ledger.check_exactly_once([0, 3], epoch=0).ok


def test_randomized_failures_never_lose_or_repeat_a_prompt():
    # Workers die at random; every requeued group is started again. At the end each prompt of
    # the epoch is trained fresh exactly once and the counts add up.
    rng = random.Random(0)
    ledger = Ledger()
    waiting = [f"g{i}" for i in range(300)]
    for i, gid in enumerate(waiting):
        ledger.queue(gid, i, epoch=0)
    running, step = [], 0
    while waiting or running:
        if waiting and (not running or rng.random() < 0.5):
            gid = waiting.pop(rng.randrange(len(waiting)))
            ledger.start(gid, worker=rng.randrange(4), version=step)
            running.append(gid)
            continue
        gid = running.pop(rng.randrange(len(running)))
        if rng.random() < 0.2:
            ledger.requeue(gid, "worker died")
            waiting.append(gid)
        else:
            step += 1
            ledger.collect(gid)
            ledger.train_fresh(gid, step)
            ledger.finish(gid)
    assert ledger.check_exactly_once(range(300), epoch=0).ok
    assert ledger.counts() == {**dict.fromkeys(State, 0), State.DONE: 300}


def test_round_trip_through_json_for_checkpoints():
    ledger = Ledger()
    _fresh(ledger, "a", 0, step=3, worker=1, version=2)
    ledger.to_replay("a")
    ledger.replayed("a", 4)
    ledger.queue("b", 1, 0)
    ledger.start("b", 0, 3)
    ledger.requeue("b", "worker died")
    restored = Ledger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert restored.to_dict() == ledger.to_dict()
    assert restored.history("a") == ledger.history("a") and restored.reuses("a") == 1
    assert restored.step == 4 and restored.counts() == ledger.counts()
    restored.start("b", 1, 4)  # and it goes on from where it was
    assert restored.state("b") is State.GENERATING

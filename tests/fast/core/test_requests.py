"""The request table: legal transitions only, counts kept by the table and equal to what its
records say after any seeded random sequence, illegal transitions raising with the history."""

import random

import pytest

from eddyrl.core.requests import IllegalTransition, Purpose, Request, RequestTable, Status
from eddyrl.core.version_assignment import VersionAssignment


def _request(i):
    return Request(f"g{i}-0", None, 0, None, Purpose.TRAIN, i)


def test_a_request_walks_its_states_and_the_counts_follow():
    table = RequestTable(2)
    table.add(_request(1), 0, 0)
    assert table.pending == [{0: 1}, {}] and table.load(0) == 1
    table.move("g1-0", 1, "dora")
    assert table.pending == [{}, {0: 1}]  # counted on its target from the decision on
    assert table["g1-0"].runs_on(0) and not table["g1-0"].runs_on(1)  # the source runs it
    table.arrive("g1-0", resumed=True)
    table.pause("g1-0")
    assert table.between_turns == [{}, {0: 1}]
    table.resume("g1-0", 1)
    table.score("g1-0")
    assert table.pending == [{}, {}] and table.load(1) == 0
    table.finish("g1-0")
    assert len(table) == 0 and table.is_done("g1-0")
    assert table.events["arrive:resumed"] == 1 and table.counted("move") == 1
    table.check()


@pytest.mark.parametrize("call", [
    lambda t: t.arrive("g1-0", resumed=True),  # not moving
    lambda t: t.resume("g1-0", 0),  # not between turns
    lambda t: t.finish("g1-0"),  # not scored
    lambda t: t.place("g1-0", 0, 0),  # not parked
    lambda t: t.add(_request(1), 0, 0),  # already there
])
def test_illegal_transitions_raise_at_once_with_the_history(call):
    table = RequestTable(1)
    table.add(_request(1), 0, 0)
    with pytest.raises(IllegalTransition, match=r"g1-0 \(running on worker 0.*history: "
                                                r"\['add\(new\) -> running@0 v0'\]"):
        call(table)
    table.check()  # nothing changed


def test_a_moving_request_is_settled_before_it_restarts():
    table = RequestTable(2)
    table.add(_request(1), 0, 0)
    table.move("g1-0", 1, "dora")
    with pytest.raises(IllegalTransition, match="settle its move first"):
        table.restart("g1-0", "refused")


def test_check_finds_a_count_changed_behind_the_tables_back():
    table = RequestTable(1)
    table.add(_request(1), 0, 0)
    table.pending[0][0] += 1  # what a caller incrementing by hand would do
    with pytest.raises(AssertionError):
        table.check()


def test_the_assignment_refuses_a_placement_against_c1():
    assignment = VersionAssignment(2, 8)
    table = RequestTable(2, book=assignment)
    assignment.follow(table)
    table.add(_request(1), 0, 0)
    assignment.published(2, [0, 2])
    with pytest.raises(ValueError, match="worker 1 hosts version 2.*cannot generate version 0"):
        table.add(_request(2), 1, 0)
    with pytest.raises(ValueError, match="cannot move version 0 requests to worker 1"):
        table.move("g1-0", 1, "dora")
    assert "g2-0" not in table
    table.check()


@pytest.mark.parametrize("seed", range(20))
def test_random_transitions_keep_the_counts_equal_to_the_records(seed):
    """Random legal and illegal calls; after each, the counts recomputed from the records
    equal the kept ones, and a refused call changed nothing."""
    rng = random.Random(seed)
    table = RequestTable(3)
    made = 0
    for _ in range(400):
        records = list(table)
        request = rng.choice(records) if records and rng.random() < 0.9 else None
        worker = rng.randrange(3)
        calls = [lambda: table.add(_request(made), rng.choice([worker, None]), rng.randrange(3))]
        if request is not None:
            rid = request.id
            calls += [lambda: table.move(rid, worker, "dora"),
                      lambda: table.arrive(rid, resumed=rng.random() < 0.5),
                      lambda: table.redirect(rid, worker, "target_lost"),
                      lambda: table.restart(rid, "refused"),
                      lambda: table.place(rid, worker, rng.randrange(3)),
                      lambda: table.pause(rid), lambda: table.resume(rid, worker),
                      lambda: table.move_between_turns(rid, worker, "dora"),
                      lambda: table.relabel(rid, rng.randrange(3)),
                      lambda: table.score(rid), lambda: table.finish(rid)]
        before = ([+c for c in table.pending], [+c for c in table.between_turns],
                  {r.id: (r.status, r.worker, r.version, r.source) for r in table})
        call = rng.choice(calls)
        try:
            call()
            made += call is calls[0]
        except IllegalTransition:
            after = ([+c for c in table.pending], [+c for c in table.between_turns],
                     {r.id: (r.status, r.worker, r.version, r.source) for r in table})
            assert after == before
        table.check()
        for r in table:
            assert r.status in Status

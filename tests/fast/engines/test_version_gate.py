"""The version gate's contract (eddyrl/engines/inference/versions.py): which requests join,
wait or are refused, when staged weights apply, and which version each token carries. Pure
state, so every case is a few calls; the engines' own contract tests (test_engine_contract.py,
tests/fast/sim/test_sim_engine.py) check that they follow it."""

import random

import pytest

from eddyrl.engines.inference.versions import (
    Admission, ONE_VERSION, PER_TOKEN, VersionGate, call_version, token_policy)

JOIN, WAIT, REFUSE = Admission.JOIN, Admission.WAIT, Admission.REFUSE


def _busy(version=0, running=1, **kwargs):
    gate = VersionGate(version, **kwargs)
    gate.started(running)
    return gate


def test_the_hosted_version_joins_a_newer_one_waits_an_older_one_is_refused():
    gate = _busy(1)
    assert gate.stage(2) is False  # requests run: staged, held for a request that needs it
    assert (gate.hosted, gate.staged, gate.held) == (1, 2, True)
    assert gate.admit(1) is JOIN  # the hosted version still takes requests (legacy fill)
    assert gate.admit(2) is WAIT and not gate.can_switch()
    assert gate.admit(0) is REFUSE  # its weights are gone
    assert gate.started(1) == 1  # joined on the hosted version
    gate.finished(2)
    assert gate.can_switch() and gate.admit(2) is WAIT  # drained: apply, then ask again
    assert gate.apply() == 2 and (gate.hosted, gate.staged) == (2, None)
    assert gate.admit(2, waited=True) is JOIN and gate.admit(1) is REFUSE


def test_idle_weights_apply_at_once_unless_held():
    gate = VersionGate(0)
    assert gate.stage(1) is True and gate.due()  # idle: apply at once
    gate.apply()
    assert gate.stage(2, hold=True) is False  # episodes between turns come back for 1
    assert gate.held and not gate.due() and gate.admit(1) is JOIN
    assert gate.can_switch() and gate.admit(2) is WAIT  # the first newer request switches it
    assert gate.apply() == 2 and not gate.held


def test_weights_staged_while_requests_run_wait_for_a_request_not_for_the_drain():
    gate = _busy(0)
    gate.stage(1)
    gate.finished()
    assert not gate.due() and gate.staged == 1  # drained, still hosting 0
    assert gate.admit(0) is JOIN
    assert gate.admit(1) is WAIT and gate.can_switch()


def test_the_newest_staged_weights_win_and_a_waiting_request_starts_on_them():
    """A request queued for version 2 behind a running version-1 tail starts on version 3 if
    3 was staged meanwhile (the assignment's `published` relabels it); a request for 2 that
    arrives after the switch is refused."""
    gate = _busy(1)
    gate.stage(2)
    assert gate.admit(2) is WAIT
    gate.stage(3)  # replaces 2
    assert gate.staged == 3 and gate.admit(2) is WAIT  # still waiting for the drain
    gate.finished()
    assert gate.can_switch() and gate.apply() == 3
    assert gate.admit(2, waited=True) is JOIN  # it waited: it takes the newest
    assert gate.admit(2) is REFUSE  # a newcomer for 2: those weights were never hosted here
    assert gate.started() == 3


def test_none_asks_for_the_newest_weights():
    gate = VersionGate(4)
    assert gate.admit(None) is JOIN
    gate.started()
    gate.stage(5)
    assert gate.admit(None) is WAIT and not gate.can_switch()  # as a request for 5
    gate.finished()
    assert gate.can_switch()
    gate.apply()
    assert gate.admit(None, waited=True) is JOIN and gate.hosted == 5


def test_under_one_version_per_request_tokens_carry_the_version_they_started_on():
    gate = _busy(0)
    assert gate.policy is ONE_VERSION and gate.token_version() == 0
    gate.stage(1)
    assert not gate.due() and not gate.can_switch()
    assert gate.may_continue(0) and gate.token_version() == 0
    with pytest.raises(ValueError, match=r"cannot apply version 1: .*1 running.*C1"):
        gate.apply()


def test_partial_rollout_applies_at_the_next_step_and_running_requests_go_on():
    gate = _busy(0, running=2, partial_rollout=True)
    assert gate.policy is PER_TOKEN
    assert gate.stage(1) is False  # not "idle, at once": requests run
    assert gate.due() and gate.can_switch()  # at the next step boundary all the same
    tokens = [gate.token_version()]
    gate.apply()
    tokens.append(gate.token_version())
    assert tokens == [0, 1] and gate.may_continue(0) and gate.running == 2
    assert gate.admit(0) is JOIN and gate.admit(7) is JOIN  # versions are not asked for
    gate.stage(2, hold=True)
    assert gate.due()  # hold keeps nothing back: the next turn goes on with new weights
    assert gate.admit(None) is WAIT and gate.can_switch()


def test_switching_partial_rollout_on_makes_held_weights_due_and_off_again_holds_them():
    gate = _busy(0)
    gate.stage(1)
    assert not gate.due()
    gate.partial_rollout = True
    assert gate.due() and gate.policy is token_policy(True)
    gate.partial_rollout = False
    assert not gate.due() and not gate.may_continue(-1)


def test_illegal_calls_name_the_state():
    gate = _busy(3)
    with pytest.raises(ValueError, match="request r9 needs version 4; this engine hosts 3 "
                                         "and has nothing staged"):
        gate.admit(4, who="request r9")
    gate.stage(4)
    with pytest.raises(ValueError, match="needs version 5; this engine hosts 3 and has 4"):
        gate.admit(5)
    with pytest.raises(ValueError, match="hosts version 3, version 4 staged .held., 1 running"):
        gate.apply()
    with pytest.raises(ValueError, match=r"finished\(2\).*1 running"):
        gate.finished(2)
    with pytest.raises(ValueError, match=r"started\(-1\)"):
        gate.started(-1)
    gate.finished()
    gate.apply()
    with pytest.raises(ValueError, match="apply with nothing staged.*hosts version 4"):
        gate.apply()
    assert "hosts version 4, nothing staged, 0 running" in repr(gate)


def test_a_generate_call_asks_for_one_version():
    assert call_version([None, 3, 3]) == 3 and call_version([None]) is None
    with pytest.raises(ValueError, match=r"mixes versions \[1, 2\]; split it"):
        call_version([1, None, 2])


@pytest.mark.parametrize("seed", range(20))
def test_random_calls_keep_one_version_per_request(seed):
    """Requests that start, take tokens and finish while weights are staged, held and applied
    at random, driven as an engine drives the gate: without partial rollout every token of a
    request carries the version it joined; nothing is applied under a running request."""
    rng = random.Random(seed)
    gate = VersionGate(0)
    running: dict[int, tuple[int, list[int]]] = {}  # request -> (joined on, tokens' versions)
    waiting: dict[int, int | None] = {}  # request -> the version it asked for
    waited: set[int] = set()  # told to WAIT before
    latest, done = 0, []
    for n in range(400):
        action = rng.random()
        if action < 0.1:
            latest += 1
            if gate.stage(latest, hold=rng.random() < 0.3):
                gate.apply()
        elif action < 0.35:
            version = rng.choice([gate.hosted, latest, None])
            if version is not None and version > gate.hosted and gate.staged is None:
                continue  # not staged here: an engine's caller never asks for it
            waiting[n] = version
        elif action < 0.55 and waiting:
            rid = rng.choice(sorted(waiting))
            admission = gate.admit(waiting[rid], waited=rid in waited)
            if admission is WAIT and gate.can_switch():
                gate.apply()
                waited.add(rid)
                admission = gate.admit(waiting[rid], waited=True)
            if admission is WAIT:
                waited.add(rid)
                continue
            asked = waiting.pop(rid)
            if admission is JOIN:
                assert asked in (None, gate.hosted) or rid in waited  # else: superseded
                running[rid] = (gate.started(), [])
            else:
                assert asked < gate.hosted and rid not in waited
        elif action < 0.85 and running:
            running[rng.choice(sorted(running))][1].append(gate.token_version())
        elif running:
            done.append(running.pop(rng.choice(sorted(running))))
            gate.finished()
        assert gate.running == len(running)
    assert all(set(tokens) <= {joined} for joined, tokens in [*done, *running.values()])


# -- wait_for_admission: the engines' one waiting loop ------------------------------------------

def test_a_waiting_request_starts_on_the_staged_weights_once_the_engine_drains():
    import asyncio

    from eddyrl.engines.inference.versions import wait_for_admission

    async def scenario():
        gate, drained, applied = _busy(0), asyncio.Event(), []
        gate.stage(1)

        def apply():
            applied.append(gate.staged)
            gate.apply()

        waiting = asyncio.ensure_future(wait_for_admission(gate, 1, "request r", apply_staged=apply,
                                                           drained=drained))
        await asyncio.sleep(0)
        assert not waiting.done() and applied == []  # the running request keeps version 0
        gate.finished(1)
        drained.set()
        assert await waiting is True and applied == [1] and gate.hosted == 1
        # an older version is refused at once; an async apply is awaited; and nothing is
        # asked while `not_switching` is clear
        assert await wait_for_admission(gate, 0, "request s", apply_staged=apply,
                                        drained=drained) is False
        gate.stage(2)
        switching = asyncio.Event()

        async def apply_async():
            await asyncio.sleep(0)
            gate.apply()

        later = asyncio.ensure_future(wait_for_admission(
            gate, 2, "request t", apply_staged=apply_async, drained=drained,
            not_switching=switching))
        await asyncio.sleep(0)
        assert not later.done() and gate.hosted == 1
        switching.set()
        assert await later is True and gate.hosted == 2

    asyncio.run(scenario())


def test_a_resumed_request_that_waited_is_refused_when_its_version_was_superseded():
    """A fresh request that waited for version 5 may start on 6 staged meanwhile (the rollout
    relabels it); a resumed one carries version-5 tokens, and 6 continuing them would mix two
    versions in one trajectory (C1): it is refused and regenerated. Found as {5, 6} in one
    trained row of tests/integration/core/test_controller.py's multiversion test on real engines."""
    gate = _busy(4)
    gate.stage(5)
    assert gate.admit(5, resumed=True) is WAIT and gate.admit(5) is WAIT
    gate.stage(6)  # superseded while they wait
    gate.finished(1)
    gate.apply()
    assert gate.hosted == 6
    assert gate.admit(5, waited=True) is JOIN  # fresh: the newest weights
    assert gate.admit(5, waited=True, resumed=True) is REFUSE
    assert gate.admit(6, resumed=True) is JOIN  # its own version: as ever

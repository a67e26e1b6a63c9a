"""Multi-turn episodes across weight updates, deterministically: scripted engines with the
`hf` engine's version contract (tests/support/scripted_engine.py), scripted environments that
answer when the test opens their gate, and the real rollout, assignment and window.

Without partial rollout an episode's turns all come from one version (C1). When the worker an
episode ran on takes new weights while the episode waits for its tool, the next turn goes to
a worker that still hosts the version, with the turns so far; only when none does, the
episode starts over on the latest version, counted with why. The assignment keeps new-version
work off a worker whose weights an episode between turns waits for. With partial rollout the
next turn runs on the new weights, each token recording its version.
"""

import asyncio

from scripted_engine import STOP, ScriptedEngine, until

from eddyrl.core.requests import Status
from eddyrl.core.episodes import Episodes
from eddyrl.core.ledger import Ledger
from eddyrl.core.version_assignment import VersionAssignment
from eddyrl.core.rewarding import SafeReward
from eddyrl.core.rollout import StreamingRollout
from eddyrl.protocol import Group, SamplingParams
from eddyrl.core.version_window import VersionWindow
from eddyrl.envs import Environment, EpisodeLimits, Reply
from eddyrl.envs.loading import EnvironmentFactory
from eddyrl.runtime.inprocess import InProcessRuntime

OK = [ord("o"), ord("k")]  # the observation "ok", one id per character


class Chars:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class Gated(Environment):
    """Turn k of prompt p does `scripts[p][k - 1]`: "ok" answers "ok" at once, "wait" answers
    once `gates[p]` is set, "done" ends the episode with reward 1."""

    def __init__(self, *, scripts, gates, closed, **base):
        super().__init__(**base)
        self.script, self.gate, self.closed = scripts[self.prompt], gates.get(self.prompt), closed

    async def respond(self, action):
        what = self.script[self.turns - 1]
        if what == "done":
            return Reply(done=True, reward=1.0)
        if what == "wait":
            await self.gate.wait()
        return Reply(text="ok", tool="calc")

    async def close(self):
        self.closed.append(self.prompt)


def _rollout(engines, scripts, gates, *, partial=False, slots=64, batch=2):
    factory = EnvironmentFactory(Gated, "Gated", dict(
        tokenizer=Chars(), limits=EpisodeLimits(), scripts=scripts, gates=gates, closed=[]))
    decode = lambda ids: "x" * len(ids)  # noqa: E731
    window = VersionWindow(max_staleness=1, batch_groups=batch, max_concurrent=8)
    return StreamingRollout(InProcessRuntime(engines), window,
                            VersionAssignment(len(engines), slots), Ledger(),
                            SafeReward(lambda text, answer: 0.0), decode,
                            partial_rollout=partial, episodes=Episodes(factory, decode))


def _dispatch(rollout, name, n=1, worker=None):
    rollout.ledger.queue(name, len(rollout.ledger.counts()), 0)
    rollout.dispatch([Group(name, name, "1", [5, 6], 0)], n, SamplingParams(max_new_tokens=40),
                     worker=worker)
    return [r for r in rollout.table if r.id.startswith(f"{name}-")]


async def _publish(rollout, engines, version):
    for engine in engines:
        await engine.load_weights(version)
    rollout.window.advance()
    rollout.published(version, [engine.version for engine in engines])


def _by_id(groups):
    return {g.group_id: g.trajectories[0].result for g in groups}


def test_an_episode_whose_worker_took_new_weights_goes_on_where_its_version_is_hosted():
    async def scenario():
        engines = [ScriptedEngine(10), ScriptedEngine(11)]
        gates, engines[1].holds["b"] = {"a": asyncio.Event()}, asyncio.Event()
        rollout = _rollout(engines, {"a": ("wait", "done"), "b": ("done",)}, gates)
        (a,) = _dispatch(rollout, "a", worker=0)
        _dispatch(rollout, "b", worker=1)  # held: worker 1 stays busy on version 0
        await until(lambda: a.status is Status.BETWEEN_TURNS)  # turn 1 done; its tool call runs
        await _publish(rollout, engines, 1)
        assert [e.version for e in engines] == [1, 0]  # idle: applied; busy: staged
        gates["a"].set()
        await until(lambda: not any(r.id.startswith("a-") for r in rollout.table))  # a finished
        engines[1].holds["b"].set()
        return rollout, engines, await rollout.next_batch()

    rollout, engines, groups = asyncio.run(scenario())
    a = _by_id(groups)["a"]
    # turn 1 on worker 0 (token 10), the observation, turn 2 on worker 1 (token 11)
    assert a.token_ids == [10, 10, STOP, *OK, 11, 11, STOP]
    assert a.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert set(a.versions) == {0}  # C1: one version, its turns kept
    assert ("a-0", 0) in engines[1].started
    assert (rollout.restarted, rollout.migrated) == (0, 1)
    assert rollout.episodes.stats.metrics()["env/restarted_episodes"] == 0
    assert rollout.assignment.pending == [{}, {}]
    assert rollout.assignment.between_turns == [{}, {}]


def test_an_episode_restarts_only_when_no_worker_hosts_its_version_and_is_counted():
    async def scenario():
        engines = [ScriptedEngine(10)]
        gates = {"a": asyncio.Event()}
        rollout = _rollout(engines, {"a": ("wait", "done")}, gates, batch=1)
        (a,) = _dispatch(rollout, "a")
        await until(lambda: a.status is Status.BETWEEN_TURNS)
        await _publish(rollout, engines, 1)  # the only worker is idle: version 0 is gone
        gates["a"].set()
        return rollout, engines, await rollout.next_batch()

    rollout, engines, groups = asyncio.run(scenario())
    a = _by_id(groups)["a"]
    assert a.token_ids == [10, 10, STOP, *OK, 10, 10, STOP]  # a whole new episode
    assert set(a.versions) == {1}  # C1: started over on the latest version
    assert engines[0].started == [("a-0", 0), ("a-0", 1), ("a-0", 1)]
    assert rollout.restarted == 1
    metrics = rollout.episodes.stats.metrics()
    assert metrics["env/restarted_episodes"] == 1
    assert metrics["env/restarted_by/version_retired"] == 1
    assert rollout.episodes.factory.kwargs["closed"] == ["a", "a"]  # old and new env closed
    assert rollout.assignment.pending == [{}] and rollout.assignment.between_turns == [{}]


def test_a_sync_holds_an_idle_workers_version_for_its_episode_between_turns():
    """As above, but published as the controller does, with `hold=rollout.holding()`: the idle
    worker stages version 1 instead of applying it, so the episode's next turn finds version 0
    and nothing starts over; the first version-1 request then makes the engine switch."""
    async def scenario():
        engines = [ScriptedEngine(10)]
        gates = {"a": asyncio.Event()}
        rollout = _rollout(engines, {"a": ("wait", "done"), "b": ("done",)}, gates, batch=1)
        (a,) = _dispatch(rollout, "a")
        await until(lambda: a.status is Status.BETWEEN_TURNS)
        held = rollout.holding()
        await engines[0].load_weights(1, hold=0 in held)
        rollout.window.advance()
        rollout.published(1, [engines[0].version])
        versions_after_sync = engines[0].version
        gates["a"].set()
        first = await rollout.next_batch()
        _dispatch(rollout, "b")
        second = await rollout.next_batch()
        return rollout, engines, held, versions_after_sync, first + second

    rollout, engines, held, version_after_sync, groups = asyncio.run(scenario())
    assert held == [0] and version_after_sync == 0  # staged, not applied
    results = _by_id(groups)
    assert results["a"].token_ids == [10, 10, STOP, *OK, 10, 10, STOP]
    assert set(results["a"].versions) == {0}  # its turns kept, on its version (C1)
    assert set(results["b"].versions) == {1}  # the next new request switched the engine
    assert rollout.restarted == 0
    assert rollout.episodes.stats.metrics()["env/restarted_episodes"] == 0


def test_new_version_work_keeps_off_a_worker_whose_episode_waits_for_its_version():
    """Worker 0 runs b and hosts a, between turns, both on version 0; worker 1 took version 1
    and has four version-1 requests queued. A new request c would go to worker 0 by queue
    length (2 + a batch of 1 < 4), which would make it switch as soon as b ends and throw a
    away; the assignment sends it to worker 1, and a's next turn still finds version 0."""
    async def scenario():
        engines = [ScriptedEngine(10), ScriptedEngine(11)]
        gates = {"a": asyncio.Event()}
        engines[0].holds["b"], engines[1].holds["x"] = asyncio.Event(), asyncio.Event()
        rollout = _rollout(engines, {"a": ("wait", "done"), "b": ("done",), "x": ("done",),
                                     "c": ("done",)}, gates, slots=1)
        (a,) = _dispatch(rollout, "a", worker=0)
        _dispatch(rollout, "b", worker=0)
        await until(lambda: a.status is Status.BETWEEN_TURNS)
        await _publish(rollout, engines, 1)
        assert [e.version for e in engines] == [0, 1]
        _dispatch(rollout, "x", n=4, worker=1)
        (c,) = _dispatch(rollout, "c")
        assert c.worker == 1
        engines[0].holds["b"].set()  # worker 0 drains b: nothing asks it to switch
        await until(lambda: engines[0].stats().running == 0)
        gates["a"].set()
        engines[1].holds["x"].set()
        groups = await rollout.next_batch()
        await rollout.drain()
        return rollout, engines, groups

    rollout, engines, groups = asyncio.run(scenario())
    a = _by_id(groups)["a"]
    assert a.token_ids == [10, 10, STOP, *OK, 10, 10, STOP] and set(a.versions) == {0}
    assert engines[0].version == 0 and rollout.restarted == 0  # still hosts version 0
    assert [v for rid, v in engines[1].started if rid == "c-0"] == [1]


def test_with_partial_rollout_the_next_turn_runs_on_the_new_weights():
    async def scenario():
        engines = [ScriptedEngine(10, partial_rollout=True)]
        gates = {"a": asyncio.Event()}
        rollout = _rollout(engines, {"a": ("wait", "done")}, gates, partial=True, batch=1)
        (a,) = _dispatch(rollout, "a")
        await until(lambda: a.status is Status.BETWEEN_TURNS)
        await _publish(rollout, engines, 1)
        gates["a"].set()
        return rollout, await rollout.next_batch()

    rollout, groups = asyncio.run(scenario())
    a = _by_id(groups)["a"]
    assert a.token_ids == [10, 10, STOP, *OK, 10, 10, STOP]
    # turn 1 and the observation answering it on version 0, turn 2 on version 1
    assert a.versions == [0, 0, 0, 0, 0, 1, 1, 1]
    assert a.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert rollout.restarted == 0 and rollout.migrated == 0

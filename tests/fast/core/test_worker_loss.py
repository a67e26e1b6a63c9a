"""A rollout worker's process dies mid-generation: its requests are regenerated elsewhere from
scratch (one version per trajectory), the ledger records the requeue, nothing is lost, and the
replacement the runtime starts takes work again. Deterministic: scripted engines (the `hf`
version contract, no model) in a runtime that can lose and replace them."""

import asyncio

from fake_runtime import RecordingRuntime
from scripted_engine import ScriptedEngine, until

from eddyrl.core.requests import Purpose, Status
from eddyrl.core.ledger import Ledger, State
from eddyrl.core.version_assignment import VersionAssignment
from eddyrl.core.rewarding import SafeReward
from eddyrl.core.rollout import StreamingRollout
from eddyrl.protocol import Group, SamplingParams
from eddyrl.core.version_window import VersionWindow


def lossy_runtime(engines):
    """Scripted engines a test can kill; a replacement is a fresh scripted engine."""
    return RecordingRuntime(engines, replacement=lambda: ScriptedEngine(token=7))


def _rollout(runtime):
    window = VersionWindow(max_staleness=1, batch_groups=1, max_concurrent=8)
    return StreamingRollout(runtime, window, VersionAssignment(len(runtime.workers), 64),
                            Ledger(), SafeReward(lambda text, answer: 1.0),
                            lambda ids: "x" * len(ids), recovery=runtime)


def _dispatch(rollout, name, n, worker):
    rollout.ledger.queue(name, len(rollout.ledger.counts()), 0)
    rollout.dispatch([Group(name, name, "1", [5, 6], 0)], n, SamplingParams(max_new_tokens=40),
                     worker=worker)


def test_a_lost_workers_requests_are_regenerated_and_the_replacement_comes_back():
    async def run():
        engines = [ScriptedEngine(token=3), ScriptedEngine(token=4)]
        engines[0].holds["g0"] = asyncio.Event()  # busy: nothing of g0 finishes on worker 0
        runtime = lossy_runtime(engines)
        rollout = _rollout(runtime)
        _dispatch(rollout, "g0", 2, worker=0)
        await until(lambda: engines[0]._running == 2)
        runtime.kill(0)
        engines[0].holds["g0"].set()  # its next step reaches the (dead) stream
        await until(lambda: rollout.workers_lost == 1)
        assert rollout.assignment.available == [False, True]
        batch = await rollout.next_batch()
        # both samples regenerated on worker 1 from scratch, each on one version (C1)
        assert [len(t.result.token_ids) for t in batch[0].trajectories] == [3, 3]
        assert {tuple(t.result.token_ids[:2]) for t in batch[0].trajectories} == {(4, 4)}
        assert all(len(set(t.result.versions)) == 1 for t in batch[0].trajectories)
        assert rollout.regenerated == 2
        history = rollout.ledger.to_dict()["groups"]["g0"]["history"]
        assert [h["state"] for h in history].count(State.QUEUED.value) == 2  # queued, requeued
        assert any("rollout worker 0 lost" in (h.get("reason") or "") for h in history)
        # the replacement comes back on the published weights and gets work again
        runtime.replacements.set()
        await until(lambda: runtime.replaced == [0])
        await until(lambda: rollout.assignment.available == [True, True])
        _dispatch(rollout, "g1", 1, worker=0)
        await rollout.next_batch()
        assert runtime.workers[0].started == [("g1-0", 0)]
        await rollout.drain()

    asyncio.run(run())


def test_with_every_worker_lost_requests_wait_for_the_replacement():
    async def run():
        engine = ScriptedEngine(token=3)
        engine.holds["g0"] = asyncio.Event()
        runtime = lossy_runtime([engine])
        rollout = _rollout(runtime)
        _dispatch(rollout, "g0", 2, worker=0)
        await until(lambda: engine._running == 2)
        runtime.kill(0)
        engine.holds["g0"].set()
        await until(lambda: rollout.workers_lost == 1)
        assert len(rollout.table.with_status(Status.PARKED)) == 2  # nowhere to run until the worker is back
        runtime.replacements.set()
        batch = await rollout.next_batch()
        assert [len(t.result.token_ids) for t in batch[0].trajectories] == [3, 3]
        assert {t.result.token_ids[0] for t in batch[0].trajectories} == {7}  # the new engine
        history = rollout.ledger.to_dict()["groups"]["g0"]["history"]
        assert [h["state"] for h in history] == [
            State.QUEUED.value, State.GENERATING.value, State.QUEUED.value,
            State.GENERATING.value, State.COLLECTED.value]
        await rollout.drain()

    asyncio.run(run())


def test_a_lost_workers_refill_group_is_requeued_in_the_ledger_too():
    """A synchronous refill (`generate_now`, `Purpose.REFILL`) is in the ledger and is trained:
    its worker's loss is recorded as for a dispatched group: requeued, started again
    (`moves.py`, `worker_lost`)."""
    async def run():
        engines = [ScriptedEngine(token=3), ScriptedEngine(token=4)]
        engines[0].holds["r0"] = asyncio.Event()
        runtime = lossy_runtime(engines)
        rollout = _rollout(runtime)
        rollout.ledger.queue("r0", 0, 0)
        group = Group("r0", "r0", "1", [5, 6], 0)
        refill = asyncio.ensure_future(rollout.generate_now(
            [group], 2, SamplingParams(max_new_tokens=40), Purpose.REFILL))
        await until(lambda: engines[0]._running == 2)
        runtime.kill(0)
        engines[0].holds["r0"].set()
        await until(lambda: rollout.workers_lost == 1)
        await refill
        assert [len(t.result.token_ids) for t in group.trajectories] == [3, 3]
        history = rollout.ledger.to_dict()["groups"]["r0"]["history"]
        assert [h["state"] for h in history] == [
            State.QUEUED.value, State.GENERATING.value, State.QUEUED.value,
            State.GENERATING.value, State.COLLECTED.value]
        assert "rollout worker 0 lost" in history[2]["reason"]
        runtime.replacements.set()  # the replacement, which drain waits for
        await rollout.drain()

    asyncio.run(run())

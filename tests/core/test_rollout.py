"""Streaming rollout on two real `hf` engines: groups stream into the store and are collected
when complete; DORA's migration moves a legacy version's requests off a worker (abort there,
resume on a worker still hosting that version) without mixing versions or losing a sample."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from eddyrl.core.ledger import Ledger, State
from eddyrl.core.orchestrator import VersionOrchestrator
from eddyrl.core.rewarding import SafeReward
from eddyrl.core.rollout import StreamingRollout
from eddyrl.core.trajectory import Group
from eddyrl.core.version_window import VersionWindow
from eddyrl.engines.inference.base import SamplingParams
from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.hal import get_platform
from eddyrl.runtime.inprocess import InProcessRuntime


@pytest.fixture()
def two_workers(tiny_model_dir):
    engines = [HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=s) for s in (0, 1)]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    return InProcessRuntime(engines), base


def _rollout(runtime, k=2, batch=1):
    ledger = Ledger()
    window = VersionWindow(max_staleness=k, batch_groups=batch, max_concurrent=8)
    rollout = StreamingRollout(runtime, window, VersionOrchestrator(2, 64), ledger,
                               SafeReward(lambda response, answer: float(len(response) % 2)),
                               decode=lambda ids: "x" * len(ids))
    return rollout, ledger, window


def _groups(ledger, names):
    groups = [Group(name, "p", "a", [1, 2, 3 + i], 0) for i, name in enumerate(names)]
    for i, group in enumerate(groups):
        ledger.queue(group.group_id, i, 0)
    return groups


async def _publish(runtime, rollout, base, version):
    gen = torch.Generator().manual_seed(version)
    weights = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    for engine in runtime.workers:
        await engine.load_weights(version, [weights])
    rollout.window.advance()
    rollout.published(version, [engine.version for engine in runtime.workers])


def test_migration_consolidates_a_legacy_version_without_mixing_versions(two_workers):
    runtime, base = two_workers
    rollout, ledger, window = _rollout(runtime)
    sampling = SamplingParams(max_new_tokens=200)  # long: still running at the next version

    async def scenario():
        a, b = _groups(ledger, ["a", "b"])
        rollout.dispatch([a], 3, sampling, worker=0)
        rollout.dispatch([b], 2, sampling, worker=1)
        while runtime.workers[0].stats().tokens_generated < 30:
            await asyncio.sleep(0.005)
        await _publish(runtime, rollout, base, 1)
        assert rollout.orchestrator.hosted == [0, 0]  # both busy: version 1 only staged
        moving = await rollout.rebalance(new_requests=100)
        assert moving == 2  # worker 1 (fewer version-0 requests) is evacuated into worker 0
        assert rollout.orchestrator.pending[0][0] == 5
        first = await rollout.next_batch()
        second = await rollout.next_batch()
        return first + second

    groups = asyncio.run(scenario())
    assert rollout.migrated == 2
    assert sorted(g.group_id for g in groups) == ["a", "b"]
    for group in groups:
        assert len(group.trajectories) == (3 if group.group_id == "a" else 2)  # C2
        for t in group.trajectories:
            assert set(t.result.versions) == {0}  # C1 across the migration
            assert len(t.result.token_ids) == 200
    assert [ledger.state(g) for g in ("a", "b")] == [State.COLLECTED] * 2
    assert runtime.workers[1].stats().running == 0  # evacuated: free for version 1


def test_a_worker_failure_reaches_the_waiting_trainer_with_its_cause(two_workers):
    runtime, _ = two_workers
    rollout, ledger, _ = _rollout(runtime, k=0)

    def broken(worker, requests):
        async def fail():
            raise RuntimeError("rollout worker 0 failed during generate: boom")
            yield  # an async generator
        return fail()

    runtime.generate = broken

    async def scenario():
        rollout.dispatch(_groups(ledger, ["a"]), 2, SamplingParams(max_new_tokens=4))
        await rollout.next_batch()

    with pytest.raises(RuntimeError, match="worker 0 failed during generate: boom"):
        asyncio.run(scenario())


def test_a_request_refused_for_a_vanished_version_is_regenerated_on_the_latest(two_workers):
    """If a request reaches a worker that no longer hosts its version (the bookkeeping was
    behind the engine), the trajectory restarts from scratch on the latest version: one
    version per trajectory, and the group still completes."""
    runtime, base = two_workers
    rollout, ledger, window = _rollout(runtime, k=2)

    async def scenario():
        await _publish(runtime, rollout, base, 1)  # both idle: both apply version 1 at once
        # the book believes worker 1 still hosts version 0 (as if its news were late)
        rollout.orchestrator.hosted[1] = 0
        group = _groups(ledger, ["late"])[0]
        # a legacy-version group (the window still admits version 0: its deadline is ahead)
        rollout.dispatch([group], 2, SamplingParams(max_new_tokens=6), version=0, worker=1)
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert rollout.restarted == 2
    assert len(group.trajectories) == 2
    assert all(set(t.result.versions) == {1} for t in group.trajectories)  # C1

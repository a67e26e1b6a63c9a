"""Streaming rollout on two real `hf` engines: groups stream into the store and are collected
when complete; DORA's migration moves a legacy version's requests off a worker (abort there,
resume on a worker still hosting that version) without mixing versions or losing a sample."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from eddyrl.core.ledger import Ledger, State
from eddyrl.core.version_assignment import VersionAssignment
from eddyrl.core.rewarding import SafeReward
from eddyrl.core.rollout import StreamingRollout
from eddyrl.protocol import Group, SamplingParams
from eddyrl.core.version_window import VersionWindow
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
    rollout = StreamingRollout(runtime, window, VersionAssignment(2, 64), ledger,
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
        assert rollout.assignment.hosted == [0, 0]  # both busy: version 1 only staged
        moving = await rollout.rebalance(new_requests=100)
        assert moving == 2  # worker 1 (fewer version-0 requests) is evacuated into worker 0
        assert rollout.assignment.pending[0][0] == 5
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
        rollout.assignment.hosted[1] = 0
        group = _groups(ledger, ["late"])[0]
        # a legacy-version group (the window still admits version 0: its deadline is ahead)
        rollout.dispatch([group], 2, SamplingParams(max_new_tokens=6), version=0, worker=1)
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert rollout.restarted == 2
    assert len(group.trajectories) == 2
    assert all(set(t.result.versions) == {1} for t in group.trajectories)  # C1


def _routed_rollout(runtime, **routing):
    from eddyrl.scheduler.buckets import (BucketRouter, BucketSpec, RoutingConfig,
                                          bucket_instances)

    config = RoutingConfig(policy="bucket", milestones=[4], min_observations=1, window=10,
                           rebuild_every=1,
                           buckets=[BucketSpec("short", 10), BucketSpec("long", 400)], **routing)
    rollout, ledger, window = _rollout(runtime)
    rollout.use_router(BucketRouter(config, bucket_instances(config)))
    return rollout, ledger


def test_the_bucket_router_moves_long_requests_to_the_long_bucket_mid_generation(two_workers):
    """Libra on two real engines (worker 0: short bucket, worker 1: long): every request starts
    short; at the 4-token milestone the router, having learnt that this prompt's requests run
    ~36 more tokens, moves each to the long bucket (abort, resume on worker 1). Nothing is
    lost, the history is kept across the move, and the books end empty."""
    from eddyrl.scheduler.buckets import Milestone

    runtime, _ = two_workers
    rollout, ledger = _routed_rollout(runtime)
    rollout.router.trees.observe("p", [Milestone(0)], [40, 36])  # a finished request's path

    async def scenario():
        rollout.dispatch(_groups(ledger, ["a"]), 3, SamplingParams(max_new_tokens=40))
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert rollout.routed == 3 and rollout.migrated == 3
    assert len(group.trajectories) == 3  # C2
    for t in group.trajectories:
        assert len(t.result.token_ids) == len(t.result.logprobs) == 40
        assert set(t.result.versions) == {0}  # C1
    # worker 0 generated about 4 tokens per request before the move, worker 1 the rest
    generated = [engine.stats().tokens_generated for engine in runtime.workers]
    assert generated[0] < 3 * 10 and generated[1] >= 3 * 30
    stats = rollout.router.stats()
    assert stats.moves == 3 and stats.connections == {"short": 0, "long": 0}
    assert rollout.assignment.pending == [{}, {}]
    assert ledger.state("a") == State.COLLECTED


def test_a_routed_move_waits_for_an_allowed_target(two_workers):
    """The long bucket's only worker is lent to training: the router may not move there, so
    the requests finish where they started and the blocked move is counted."""
    from eddyrl.scheduler.buckets import Milestone

    runtime, _ = two_workers
    rollout, ledger = _routed_rollout(runtime)
    rollout.router.trees.observe("p", [Milestone(0)], [40, 36])
    rollout.assignment.set_available(1, False)

    async def scenario():
        rollout.dispatch(_groups(ledger, ["a"]), 2, SamplingParams(max_new_tokens=12))
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert rollout.routed == 0 and rollout.router.stats().blocked == 2
    assert [len(t.result.token_ids) for t in group.trajectories] == [12, 12]
    assert runtime.workers[1].stats().tokens_generated == 0


def test_the_router_learns_from_finished_requests(two_workers):
    """Nothing taught: the first group stays short and its lengths are learnt; the second
    group's requests, at the same milestone, are moved to the long bucket."""
    runtime, _ = two_workers
    rollout, ledger = _routed_rollout(runtime)

    async def scenario():
        rollout.dispatch(_groups(ledger, ["a"]), 2, SamplingParams(max_new_tokens=24))
        await rollout.next_batch()
        assert rollout.routed == 0
        ledger.queue("b", 1, 0)
        rollout.dispatch([Group("b", "p", "a", [1, 2, 3], 0)], 2,
                         SamplingParams(max_new_tokens=24))
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert rollout.routed == 2
    assert [len(t.result.token_ids) for t in group.trajectories] == [24, 24]

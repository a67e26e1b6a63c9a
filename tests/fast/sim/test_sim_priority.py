"""Priority scheduling in the simulated engine: requests carry their group's dispatch order
(`GenerationRequest.priority`), and a full engine admits and keeps the older ones first."""

import asyncio

import pytest

from eddyrl.protocol import GenerationRequest, SamplingParams
from eddyrl.sim.engine import SimInferenceEngine
from eddyrl.sim.clock import run_virtual
from eddyrl.scheduler.cost_model import CostModel

COST = CostModel("H100", "Qwen3-4B")


def _run(requests, **kwargs):
    engine = SimInferenceEngine(COST, length_of=lambda r: 400, correct_of=lambda r: True,
                                **kwargs)

    async def go():
        order = []
        async for result in engine.generate(requests):
            order.append(result.request_id)
        return order

    return run_virtual(go())[0], engine


def _request(rid, priority):
    return GenerationRequest(rid, [0] * 100, SamplingParams(max_new_tokens=500),
                             priority=priority)


def test_a_full_batch_admits_the_lowest_priority_value_first_whatever_the_arrival():
    arrivals = [_request(f"r{p}", p) for p in (3, 1, 2, 0)]
    order, _ = _run(arrivals, max_batch_size=1)
    assert order == ["r0", "r1", "r2", "r3"]
    fcfs, _ = _run([_request(f"r{i}", 0) for i in (3, 1, 2, 0)], max_batch_size=1)
    assert fcfs == ["r3", "r1", "r2", "r0"]  # equal priorities: arrival order


def test_a_full_kv_cache_preempts_the_lowest_priority_sequence_not_the_newest():
    """Room for about two whole sequences: the old group (priority 0) arrives last, but the
    one preempted (and so finishing last) is the lowest priority; with equal priorities it
    is the newest arrival, as in vLLM's first-come-first-served scheduler."""
    capacity = 2 * (100 + 400) + 40
    order, engine = _run([_request("new", 5), _request("newer", 6), _request("old", 0)],
                         kv_capacity_tokens=capacity)
    assert order[-1] == "newer" and engine.preemptions >= 1
    fcfs, engine = _run([_request("new", 0), _request("newer", 0), _request("old", 0)],
                        kv_capacity_tokens=capacity)
    assert fcfs[-1] == "old" and engine.preemptions >= 1


def test_a_migrated_request_can_bring_its_kv_cache_instead_of_recomputing_it():
    """DORA's migration: the resumed request's context arrives over the network link
    (kv_transfer_seconds) rather than being prefilled again; then it decodes as usual."""
    history = [0] * 2000

    def resumed():
        return GenerationRequest("m", [0] * 100, SamplingParams(max_new_tokens=3000),
                                 resume_ids=history, resume_logprobs=[0.0] * 2000,
                                 resume_versions=[0] * 2000)

    def admission_s(carry):
        engine = SimInferenceEngine(COST, length_of=lambda r: 2001, correct_of=lambda r: True,
                                    carry_kv=carry)

        async def go():
            async for _ in engine.generate([resumed()]):
                pass
        run_virtual(go())
        return engine.stats().busy_seconds - COST.decode_step_seconds(1, 2100)

    recompute, carried = admission_s(False), admission_s(True)
    assert recompute == pytest.approx(COST.prefill_seconds(2100), rel=1e-3)
    assert carried == pytest.approx(COST.prefill_seconds(0, 2100) + COST.kv_transfer_seconds(
        2100, COST.accelerator.inter_node_bandwidth), rel=1e-3)
    # Qwen3-4B on one H100: 2,100 tokens prefill in 37 ms, their 310 MB of KV cross a 50 GB/s
    # NIC in 21 ms; carrying pays more for larger models (prefill grows with parameters)
    assert carried < recompute

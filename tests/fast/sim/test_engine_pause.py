"""A weight update as a pause of the simulated engine, in the order Eddy's `vllm` engine takes
it: stop at a step boundary, load (and reset the prefix cache), then re-prefill every
interrupted sequence through the token budget in ceil(tokens / budget) steps; nothing decodes
meanwhile. Also: an idle engine's load is waited for, a delayed update pauses once the old
version drained, and a system that pauses to receive (verl) stops decoding for the transfer."""

import asyncio
import math

import pytest

from eddyrl.protocol import GenerationRequest, SamplingParams
from eddyrl.scheduler.cost_model import CostModel
from eddyrl.scheduler.rollout_cost import WeightUpdate
from eddyrl.sim.clock import run_virtual
from eddyrl.sim.engine import SimInferenceEngine

COST = CostModel("H100", "Qwen3-4B")
PROMPT = [0] * 100
UPDATE = WeightUpdate(load_s=2.0, kv_reset_s=0.5, token_budget=128)


def _engine(lengths, trace=None, **kwargs):
    return SimInferenceEngine(COST, length_of=lambda r: lengths[r.request_id],
                              correct_of=lambda r: True, trace=trace, **kwargs)


def _request(rid, **kwargs):
    return GenerationRequest(rid, PROMPT, SamplingParams(max_new_tokens=10000), **kwargs)


async def _collect(engine, requests, log):
    loop = asyncio.get_running_loop()
    async for result in engine.generate(requests):
        log.append((result.request_id, len(result.token_ids), loop.time()))


def _decode_s(batch, first_context, steps):
    return sum(COST.decode_step_seconds(batch, first_context + i) for i in range(steps))


def test_a_partial_rollout_update_pauses_loads_and_re_prefills_in_chunks():
    """Three sequences (100-token prompts) decode 31 tokens; the update then stops them at the
    step boundary: 2.5 s of load and prefix-cache reset, then their 3 x 131 = 393 tokens of
    context through a budget of 128 tokens: ceil(393 / 128) = 4 chunked steps; then they decode
    on. No decode interval overlaps the pause or the re-prefill."""
    events = []
    engine = _engine({"a": 100, "b": 100, "c": 100}, partial_rollout=True, update=UPDATE,
                     trace=lambda name, start, seconds, args: events.append(
                         (name, start, seconds, args)))
    first_prefill = 3 * COST.prefill_seconds(100)
    switch_at = first_prefill + _decode_s(3, 100, 30) + 0.5 * COST.decode_step_seconds(3, 130)
    log = []

    async def scenario():
        task = asyncio.ensure_future(_collect(engine, [_request(r) for r in "abc"], log))
        await asyncio.sleep(switch_at)
        await engine.load_weights(1)
        await task

    run_virtual(scenario())
    steps, reprefill = COST.chunked_prefill_seconds([131] * 3, 128)
    assert steps == math.ceil(393 / 128) == 4
    # (the engine times a run of decode steps at its mean context: within 1e-3 of a sum)
    pause_at = first_prefill + _decode_s(3, 100, 31)
    (pause,) = [e for e in events if e[0] == "weight update"]
    assert pause[1] == pytest.approx(pause_at, rel=1e-3) and pause[2] == pytest.approx(2.5)
    (chunked,) = [e for e in events if e[0] == "re-prefill"]
    assert chunked[1] == pytest.approx(pause[1] + 2.5)
    assert chunked[2] == pytest.approx(reprefill) and chunked[3]["steps"] == 4
    assert chunked[3]["tokens"] == 393 and chunked[3]["sequences"] == 3
    busy_until = pause[1] + 2.5 + reprefill
    assert not [e for e in events if e[0] == "decode"
                and e[1] < busy_until - 1e-9 and e[1] + e[2] > pause[1] + 1e-9]
    expected = busy_until + _decode_s(3, 131, 69)
    assert [t for _, _, t in log] == pytest.approx([expected] * 3, rel=1e-3)
    assert [n for _, n, _ in log] == [100] * 3 and engine.update_pauses == 1


def test_an_idle_engine_loads_while_its_caller_waits():
    engine = _engine({}, update=UPDATE)

    async def scenario():
        loop = asyncio.get_running_loop()
        began = loop.time()
        await engine.load_weights(1)
        return loop.time() - began

    took, _ = run_virtual(scenario())
    assert took == pytest.approx(2.5) and engine.version == 1


def test_a_delayed_update_pauses_once_the_old_version_drained():
    """Without partial rollout the running sequence finishes on the old weights (nothing is
    interrupted, nothing re-prefilled); the load comes after it, before the next request."""
    engine = _engine({"a": 50, "b": 50}, update=UPDATE)
    log = []

    async def scenario():
        first = asyncio.ensure_future(_collect(engine, [_request("a")], log))
        await asyncio.sleep(COST.prefill_seconds(100) + _decode_s(1, 100, 10))
        await engine.load_weights(1)
        await first
        await _collect(engine, [_request("b", version=1)], log)

    run_virtual(scenario())
    a_done = COST.prefill_seconds(100) + _decode_s(1, 100, 50)
    b_done = a_done + 2.5 + COST.prefill_seconds(100) + _decode_s(1, 100, 50)
    assert [t for _, _, t in log] == pytest.approx([a_done, b_done], rel=1e-3)
    assert log[1][2] - log[0][2] == pytest.approx(
        2.5 + COST.prefill_seconds(100) + _decode_s(1, 100, 50), rel=1e-3)


def test_pausing_to_receive_stops_decoding_for_the_transfer():
    """verl's rollout stops while the weights cross; the sequence ends that much later (the
    step under way completes first: within a step's time)."""
    log_plain, log_paused = [], []

    async def scenario(pause, log):
        engine = _engine({"a": 200})
        task = asyncio.ensure_future(_collect(engine, [_request("a")], log))
        await asyncio.sleep(COST.prefill_seconds(100) + 50.5 * COST.decode_step_seconds(1, 150))
        if pause:
            await engine.pause_for(3.0)
        await task

    run_virtual(scenario(False, log_plain))
    run_virtual(scenario(True, log_paused))
    assert log_paused[0][2] - log_plain[0][2] == pytest.approx(
        3.0, abs=COST.decode_step_seconds(1, 200))

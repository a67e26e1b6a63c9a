"""Multi-turn agentic episodes in the simulator: the workload's seeded tool calls, and the
simulated engine that takes a sequence off the batch while its tool runs (keeping its KV cache),
then prefills only the observation when it comes back."""

import asyncio

import pytest

from eddyrl.protocol import GenerationRequest, SamplingParams
from eddyrl.sim.engine import SimInferenceEngine
from eddyrl.errors import ConfigError
from eddyrl.sim.clock import run_virtual
from eddyrl.scheduler.cost_model import CostModel
from eddyrl.sim.workload import ToolCall, Workload, WorkloadConfig

COST = CostModel("H100", "Qwen3-4B")
PROMPT = [0] * 100


def _engine(lengths, calls, **kwargs):
    return SimInferenceEngine(COST, length_of=lambda r: lengths[r.request_id],
                              correct_of=lambda r: True,
                              episode_of=lambda r: calls.get(r.request_id, ()), **kwargs)


def _request(rid, max_new=10000, **kwargs):
    return GenerationRequest(rid, PROMPT, SamplingParams(max_new_tokens=max_new), **kwargs)


async def _collect(engine, requests, log=None):
    loop = asyncio.get_running_loop()
    out = []
    async for result in engine.generate(requests):
        out.append(result)
        if log is not None:
            log[result.request_id] = loop.time()
    return out


def _decode_s(batch, first_context, steps):
    return sum(COST.decode_step_seconds(batch, first_context + i) for i in range(steps))


def _request_for(rid):
    return GenerationRequest(rid, [0] * 511 + [7], SamplingParams(max_new_tokens=30000))


# ---- the workload -------------------------------------------------------------------------
def test_an_episode_is_seeded_by_the_request_id_and_single_turn_by_default():
    agentic = Workload(WorkloadConfig(tool_calls_mean=4.0), seed=3)
    episodes = {rid: agentic.episode(_request_for(rid)) for rid in map(str, range(200))}
    assert all(Workload(WorkloadConfig(tool_calls_mean=4.0), seed=3).episode(
        _request_for(rid)) == calls for rid, calls in episodes.items())
    multi_turn = [calls for calls in episodes.values() if calls]
    assert len(set(multi_turn)) == len(multi_turn) > 100  # different ids, different episodes
    assert 3.2 < sum(map(len, episodes.values())) / 200 < 4.8
    for rid, calls in episodes.items():
        ats = [call.at for call in calls]
        assert ats == sorted(set(ats)) and all(0 < at for at in ats)
        assert all(at < agentic.response_tokens(_request_for(rid)) for at in ats)
        assert not any(call.failed for call in calls)
    sizes = {call.size_class for calls in episodes.values() for call in calls}
    assert sizes == {"small", "large"}
    single = Workload(WorkloadConfig(), seed=3)
    assert single.episode(_request_for("0")) == ()
    assert single.response_tokens(_request_for("0")) == \
        agentic.response_tokens(_request_for("0"))  # model tokens: unchanged


def test_failed_calls_wait_for_the_timeout_and_return_error_text():
    workload = Workload(WorkloadConfig(tool_calls_mean=3.0, tool_failure_rate=1.0,
                                       tool_timeout_s=7.0, tool_error_tokens=20), seed=0)
    calls = [c for rid in map(str, range(20)) for c in workload.episode(_request_for(rid))]
    assert calls and all(c.failed and c.latency_s == 7.0 and c.payload_tokens == 20
                         for c in calls)
    with pytest.raises(ConfigError, match="tool_failure_rate"):
        WorkloadConfig(tool_failure_rate=1.5).validate("sim.workload")


# ---- the engine ---------------------------------------------------------------------------
def test_one_tool_call_takes_prefill_decode_latency_observation_prefill_and_decode():
    engine = _engine({"a": 1000}, {"a": (ToolCall(400, 3.0, 200),)})
    log = {}
    (result,), took = run_virtual(_collect(engine, [_request("a")], log))
    by_hand = (COST.prefill_seconds(100) + _decode_s(1, 100, 400) + 3.0
               + COST.prefill_seconds(200, context=500) + _decode_s(1, 700, 600))
    assert took == pytest.approx(by_hand, rel=0.01)
    assert result.finish_reason == "stop" and len(result.token_ids) == 1200  # 1000 + 200
    assert len(result.versions) == len(result.logprobs) == 1200
    assert (engine.tool_calls, engine.tool_failures, engine.tool_wait_s) == (1, 0, 3.0)
    stats = engine.stats()
    assert stats.tokens_generated == 1000  # observations are not generated
    assert stats.busy_seconds == pytest.approx(by_hand - 3.0, rel=0.01)  # idle while waiting


def test_a_sequence_waiting_for_its_tool_does_not_block_the_batch():
    engine = _engine({"a": 20, "b": 2000}, {"a": (ToolCall(10, 100.0, 50),)})
    log = {}
    run_virtual(_collect(engine, [_request("a"), _request("b")], log))
    call_at = 2 * COST.prefill_seconds(100) + _decode_s(2, 100, 10)
    b_done = call_at + _decode_s(1, 110, 1990)
    a_done = call_at + 100.0 + COST.prefill_seconds(50, context=110) + _decode_s(1, 160, 10)
    assert log["b"] == pytest.approx(b_done, rel=0.01) and b_done < call_at + 100.0
    assert log["a"] == pytest.approx(a_done, rel=0.01)


def test_abort_while_a_tool_runs_returns_the_tokens_so_far_and_frees_everything():
    engine = _engine({"a": 1000}, {"a": (ToolCall(50, 10.0, 200),)})
    call_at = COST.prefill_seconds(100) + _decode_s(1, 100, 50)

    async def scenario():
        task = asyncio.ensure_future(_collect(engine, [_request("a")]))
        await asyncio.sleep(call_at + 4.0)
        waiting = engine.stats()
        await engine.abort(["a"])
        return waiting, await task

    (waiting, (result,)), took = run_virtual(scenario())
    # while the tool runs: off the batch, not busy, its KV cache held
    assert (waiting.running, waiting.waiting) == (0, 1)
    assert waiting.kv_cache_usage == pytest.approx(150 / engine.kv_capacity_tokens)
    assert waiting.busy_seconds == pytest.approx(call_at, rel=1e-3)
    assert result.finish_reason == "abort" and len(result.token_ids) == 50
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert engine.tool_wait_s == pytest.approx(4.0) and took < call_at + 5.0


def test_a_resumed_request_skips_calls_it_passed_and_repeats_one_it_stopped_in():
    calls = {"a": (ToolCall(100, 5.0, 50), ToolCall(300, 5.0, 70))}
    engine = _engine({"a": 500, "b": 500}, {**calls, "b": calls["a"]})
    # a: stopped at 200 output tokens (past the first call); b: while its second call ran
    requests = [_request("a", resume_ids=[1] * 200, report_at=(400,)),
                _request("b", resume_ids=[1] * 350, resume_versions=[0] * 350)]
    results = run_virtual(_collect(engine, requests))[0]
    reasons = [(r.request_id, r.finish_reason, len(r.token_ids)) for r in results]
    assert ("a", "progress", 420) in reasons  # 400 passed while the observation came in
    assert {("a", "stop", 620), ("b", "stop", 620)} <= set(reasons)
    assert engine.tool_calls == 2  # a's second, b's second again


def test_an_idle_cache_gives_way_to_a_higher_ranked_sequence_and_is_prefilled_again():
    prefills = []
    engine = _engine({"a": 400, "b": 500}, {"a": (ToolCall(300, 50.0, 50),)},
                     kv_capacity_tokens=700,
                     trace=lambda name, start, s, args: prefills.append(s)
                     if name == "prefill" else None)

    async def scenario():
        first = asyncio.ensure_future(_collect(engine, [_request("a", max_new=600,
                                                                 priority=1)]))
        await asyncio.sleep(COST.prefill_seconds(100) + _decode_s(1, 100, 300) + 1.0)
        second = await _collect(engine, [_request("b", max_new=600, priority=0)])
        return await first + second

    results = run_virtual(scenario())[0]
    assert sorted((r.request_id, len(r.token_ids)) for r in results) == [("a", 450), ("b", 500)]
    assert all(r.finish_reason == "stop" for r in results)
    assert engine.preemptions == 1  # a's cache, dropped while its tool ran
    assert prefills[-1] == pytest.approx(COST.prefill_seconds(450))  # its whole context


def test_an_observation_that_reaches_max_new_tokens_ends_the_request_there():
    engine = _engine({"a": 500}, {"a": (ToolCall(100, 5.0, 300),)})
    (result,), _ = run_virtual(_collect(engine, [_request("a", max_new=250)]))
    assert (result.finish_reason, len(result.token_ids), len(result.versions)) == \
        ("length", 250, 250)
    assert engine.stats().kv_cache_usage == 0.0


def test_a_request_waiting_for_new_weights_starts_once_a_tool_answer_ends_the_last_holder():
    # the old version's last holder ends inside its tool's answer (the observation reaches
    # max_new_tokens), off the batch, while a request for the staged version waits for it to
    # drain: the engine must wake and switch (it used to sleep on: libra_48 at 24:24, step 8)
    engine = _engine({"a": 500, "b": 50}, {"a": (ToolCall(100, 5.0, 300),)})

    async def scenario():
        first = asyncio.ensure_future(_collect(engine, [_request("a", max_new=250, version=0)]))
        await asyncio.sleep(1.0)  # "a" is waiting for its tool
        await engine.load_weights(1)  # staged: "a" holds version 0
        second = await _collect(engine, [_request("b", version=1)])
        return await first, second

    ((a,), (b,)), _ = run_virtual(scenario())
    assert (a.finish_reason, len(a.token_ids), set(a.versions)) == ("length", 250, {0})
    assert (b.finish_reason, len(b.token_ids), set(b.versions)) == ("stop", 50, {1})
    assert engine.version == 1

"""The simulated inference engine: continuous batching timed by the cost model, KV capacity
and preemption, and the same contract as `hf` (versions, staged weights, abort, progress)."""

import asyncio

import pytest

from eddyrl.protocol import GenerationRequest, SamplingParams
from eddyrl.sim.engine import SimInferenceEngine
from eddyrl.sim.clock import run_virtual
from eddyrl.scheduler.cost_model import CostModel

COST = CostModel("H100", "Qwen3-4B")
PROMPT = [0] * 100


def _engine(lengths, **kwargs):
    return SimInferenceEngine(COST, length_of=lambda r: lengths[r.request_id],
                              correct_of=lambda r: r.request_id.startswith("ok"), **kwargs)


def _request(rid, max_new=10000, **kwargs):
    return GenerationRequest(rid, PROMPT, SamplingParams(max_new_tokens=max_new), **kwargs)


async def _collect(engine, requests, log=None):
    loop = asyncio.get_running_loop()
    out = []
    async for result in engine.generate(requests):
        out.append(result)
        if log is not None:
            log.append((result.request_id, result.finish_reason, len(result.token_ids),
                        loop.time()))
    return out


def _decode_s(batch, first_context, steps):
    """Steps of `batch` sequences whose context grows from first_context, one token a step."""
    return sum(COST.decode_step_seconds(batch, first_context + i) for i in range(steps))


def test_continuous_batching_times_match_the_cost_model_by_hand():
    engine = _engine({"a": 100, "ok-b": 300})
    log = []
    run_virtual(_collect(engine, [_request("a"), _request("ok-b")], log))
    prefill = 2 * COST.prefill_seconds(100)
    a_done = prefill + _decode_s(2, 100, 100)
    b_done = a_done + _decode_s(1, 200, 200)
    (a, reason_a, len_a, t_a), (b, reason_b, len_b, t_b) = log
    assert (a, reason_a, len_a) == ("a", "stop", 100) and (b, len_b) == ("ok-b", 300)
    assert t_a == pytest.approx(a_done, rel=1e-3) and t_b == pytest.approx(b_done, rel=1e-3)
    stats = engine.stats()
    assert stats.tokens_generated == 400 and stats.busy_seconds == pytest.approx(t_b)


def test_tokens_say_whether_the_answer_is_right_and_length_caps_at_max_new_tokens():
    engine = _engine({"ok-a": 50, "b": 80})
    results = run_virtual(_collect(engine, [_request("ok-a"), _request("b", max_new=60)]))[0]
    by_id = {r.request_id: r for r in results}
    assert set(by_id["ok-a"].token_ids) == {1} and set(by_id["b"].token_ids) == {0}
    assert by_id["b"].finish_reason == "length" and len(by_id["b"].token_ids) == 60
    assert len(by_id["b"].logprobs) == len(by_id["b"].versions) == 60


def test_a_request_arriving_later_joins_the_running_batch():
    engine = _engine({"a": 1000, "b": 10})

    async def scenario():
        first = asyncio.ensure_future(_collect(engine, [_request("a")]))
        await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await _collect(engine, [_request("b")])
        return loop.time() - began, await first

    took, _ = run_virtual(scenario())[0]
    assert took < 10 * COST.decode_step_seconds(2, 2000) + COST.prefill_seconds(100) + \
        COST.decode_step_seconds(1, 2000)  # joined at the next step, not after "a"


def test_abort_returns_partial_output_and_progress_is_reported():
    engine = _engine({"a": 1000})

    async def scenario():
        results = []

        async def consume():
            async for r in engine.generate([_request("a", report_at=(10, 20))]):
                results.append(r)
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(50 * COST.decode_step_seconds(1, 150))
        await engine.abort(["a"])
        await task
        return results

    results = run_virtual(scenario())[0]
    assert [(r.finish_reason, len(r.token_ids)) for r in results[:2]] == [("progress", 10),
                                                                        ("progress", 20)]
    assert results[-1].finish_reason == "abort" and 40 < len(results[-1].token_ids) < 60


def test_full_kv_cache_preempts_the_newest_and_it_resumes_with_its_tokens():
    engine = _engine({"a": 300, "b": 300}, kv_capacity_tokens=500)
    requests = [_request("a", max_new=400), _request("b", max_new=400)]
    results = run_virtual(_collect(engine, requests))[0]
    assert engine.preemptions >= 1
    assert sorted(len(r.token_ids) for r in results) == [300, 300]
    assert all(r.finish_reason == "stop" for r in results)


def test_versions_join_wait_for_staged_or_are_refused():
    engine = _engine({"a": 200, "b": 10, "c": 10, "d": 10})

    async def scenario():
        running = asyncio.ensure_future(_collect(engine, [_request("a", version=0)]))
        await asyncio.sleep(0.1)
        await engine.load_weights(1)  # busy: staged, version 0 still hosted
        assert (engine.version, engine.stats().staged_version) == (0, 1)
        joined = await _collect(engine, [_request("b", version=0)])  # joins version 0
        newer = asyncio.ensure_future(_collect(engine, [_request("c", version=1)]))
        a = await running
        c = await newer  # ran after "a" drained, on version 1
        refused = await _collect(engine, [_request("d", version=0)])
        return a, joined, c, refused

    a, joined, c, refused = run_virtual(scenario())[0]
    assert set(a[0].versions) == {0} and set(joined[0].versions) == {0}
    assert set(c[0].versions) == {1} and engine.version == 1
    assert refused[0].finish_reason == "refused"


def test_partial_rollout_records_each_tokens_version():
    engine = _engine({"a": 100}, partial_rollout=True)

    async def scenario():
        task = asyncio.ensure_future(_collect(engine, [_request("a")]))
        await asyncio.sleep(30.5 * COST.decode_step_seconds(1, 120))
        await engine.load_weights(1)
        return await task

    (result,) = run_virtual(scenario())[0]
    runs = result.versions.runs()
    assert [v for v, _ in runs] == [0, 1] and sum(n for _, n in runs) == 100


def test_partial_rollout_re_prefills_running_sequences_under_the_new_weights():
    """Their KV cache came from the old weights: the switch costs a prefill of each running
    sequence's whole context (prompt and tokens so far) through the engine's token budget, as
    the vllm engine's abort-and-resume does, and generation then goes on where it stopped."""
    engine = _engine({"a": 100}, partial_rollout=True)
    switch_at = COST.prefill_seconds(100) + 30.5 * COST.decode_step_seconds(1, 115)
    log = []

    async def scenario():
        task = asyncio.ensure_future(_collect(engine, [_request("a")], log))
        await asyncio.sleep(switch_at)
        await engine.load_weights(1)
        return await task

    (result,) = run_virtual(scenario())[0]
    expected = (COST.prefill_seconds(100) + _decode_s(1, 100, 31)
                + COST.chunked_prefill_seconds([131], engine.update.token_budget)[1]
                + _decode_s(1, 131, 69))
    assert log[-1][3] == pytest.approx(expected, rel=2e-3)
    assert result.versions.runs() == [(0, 31), (1, 69)] and engine.preemptions == 0

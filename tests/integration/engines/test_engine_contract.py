"""The inference-engine contract, on every engine (`hf`, `vllm`) with the tiny model on the CPU.
The `engine` fixture (conftest.py) is parametrised over the engines; counters are read as
differences, since the vllm engine is shared by the tests."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from eddyrl.protocol import GenerationRequest, SamplingParams


def _requests(n, max_new=12, prompt=(1, 35, 33, 19), temperature=1.0):
    return [GenerationRequest(f"r{i}", list(prompt) + [5 + i % 7],
                              SamplingParams(max_new_tokens=max_new + i, temperature=temperature))
            for i in range(n)]


async def _collect(engine, requests):
    return [r async for r in engine.generate(requests)]


async def _until_generated(engine, tokens):
    """Wait until the engine generated `tokens` more tokens than when called."""
    goal = engine.stats().tokens_generated + tokens
    while engine.stats().tokens_generated < goal:
        await asyncio.sleep(0.001)


def test_generate_returns_every_request_with_logprobs_and_versions(engine):
    before = engine.stats().tokens_generated
    results = asyncio.run(_collect(engine, _requests(6)))
    assert sorted(r.request_id for r in results) == [f"r{i}" for i in range(6)]
    for r in results:
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions) > 0
        assert set(r.versions) == {0}
        assert r.finish_reason in ("stop", "length")
        assert all(lp <= 0 for lp in r.logprobs)
    stats = engine.stats()
    assert stats.running == stats.waiting == 0
    assert stats.tokens_generated - before == sum(len(r.token_ids) for r in results)
    assert stats.busy_seconds > 0


def test_logprobs_agree_with_a_plain_forward(engine, tiny_model_dir):
    """Same tokens, same weights: the sampler's log-probs equal a full recompute."""
    results = asyncio.run(_collect(engine, _requests(8, max_new=20)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for r in results:
        ids = torch.tensor([r.prompt_ids + r.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        p = len(r.prompt_ids)
        expected = logp[p - 1:].gather(-1, torch.tensor(r.token_ids)[:, None]).squeeze(-1)
        assert (expected - torch.tensor(r.logprobs)).abs().max().item() < 1e-4


def test_abort_returns_partial_output(engine):
    async def scenario():
        requests = _requests(3, max_new=120)
        stream = engine.generate(requests)
        first = []

        async def consume():
            async for result in stream:
                first.append(result)

        task = asyncio.create_task(consume())
        await _until_generated(engine, 9)
        await engine.abort(["r1"])
        await task
        return first

    results = {r.request_id: r for r in asyncio.run(scenario())}
    assert set(results) == {"r0", "r1", "r2"}
    aborted = results["r1"]
    assert aborted.finish_reason == "abort" and not aborted.finished
    assert 0 < len(aborted.token_ids) < 121
    assert len(aborted.token_ids) == len(aborted.logprobs) == len(aborted.versions)


def test_resumed_request_keeps_its_history(engine):
    first = asyncio.run(_collect(engine, _requests(1, max_new=6, temperature=0.0)))[0]
    head = 3
    resumed = GenerationRequest("again", first.prompt_ids, SamplingParams(max_new_tokens=6,
                                                                          temperature=0.0),
                                resume_ids=first.token_ids[:head],
                                resume_logprobs=first.logprobs[:head],
                                resume_versions=[9] * head)
    out = asyncio.run(_collect(engine, [resumed]))[0]
    assert out.token_ids == first.token_ids  # greedy: same continuation from the same prefix
    assert out.versions[:head] == [9] * head and set(out.versions[head:]) == {0}
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(first.logprobs))


def test_load_weights_changes_outputs_and_version(engine, tiny_model_dir):
    greedy = _requests(2, temperature=0.0)
    before = asyncio.run(_collect(engine, greedy))
    new = _shifted_weights(tiny_model_dir, 11)[0]
    names = list(new)
    buckets = [{k: new[k] for k in names[:10]}, {k: new[k] for k in names[10:]}]
    asyncio.run(engine.load_weights(4, buckets))
    after = asyncio.run(_collect(engine, greedy))
    assert engine.version == 4 and all(set(r.versions) == {4} for r in after)
    assert [r.token_ids for r in before] != [r.token_ids for r in after] or \
        [r.logprobs for r in before] != [r.logprobs for r in after]
    with pytest.raises(KeyError, match="do not belong"):
        asyncio.run(engine.load_weights(5, [{"not.a.weight": torch.zeros(1)}]))
    with pytest.raises(KeyError, match="lacks"):
        asyncio.run(engine.load_weights(5, [{names[0]: new[names[0]]}]))
    assert engine.version == 4 and engine.stats().staged_version is None
    assert [r.token_ids for r in asyncio.run(_collect(engine, greedy))] == \
        [r.token_ids for r in after]  # a refused update left the loaded weights alone


def test_sleep_and_wake(engine):
    asyncio.run(engine.sleep())
    assert engine.stats().sleeping
    with pytest.raises(RuntimeError, match="sleeping"):
        asyncio.run(_collect(engine, _requests(1)))
    asyncio.run(engine.wake())
    assert not engine.stats().sleeping
    assert len(asyncio.run(_collect(engine, _requests(2)))) == 2


def test_too_long_request_is_refused_with_its_id(engine):
    request = GenerationRequest("long", [1] * 250, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="request long: prompt"):
        asyncio.run(_collect(engine, [request]))


def _shifted_weights(tiny_model_dir, seed):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    return [{k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}]


@pytest.mark.parametrize("partial", [False, True])
def test_weights_loaded_mid_generation(engine, tiny_model_dir, partial):
    """Delayed update keeps every running trajectory on one version (C1) and applies the new
    weights once they drained; partial rollout switches at the next step and records it."""
    engine.configure(partial_rollout=partial)

    async def scenario():
        task = asyncio.create_task(_collect(engine, _requests(3, max_new=100)))
        await _until_generated(engine, 30)
        await engine.load_weights(1, _shifted_weights(tiny_model_dir, 1))
        staged = engine.stats().staged_version
        if not partial:  # a failed update leaves the staged one as it was
            with pytest.raises(KeyError, match="do not belong"):
                await engine.load_weights(2, [{"not.a.weight": torch.zeros(1)}])
            assert engine.stats().staged_version == 1 and engine.stats().running
        first = await task
        later = await _collect(engine, _requests(2, max_new=5))
        return staged, first, later

    staged, first, later = asyncio.run(scenario())
    if partial:
        assert staged is None  # applied at once
        assert all(r.versions[0] == 0 and r.versions[-1] == 1 for r in first)
        assert all(r.versions == sorted(r.versions) for r in first)
    else:
        assert staged == 1  # waiting for the running batch
        assert all(set(r.versions) == {0} for r in first)  # C1: one version per trajectory
    assert engine.version == 1 and all(set(r.versions) == {1} for r in later)


def _versioned(n, version, max_new=40, prefix="v"):
    return [GenerationRequest(f"{prefix}{version}-{i}", [1, 2, 3 + i],
                              SamplingParams(max_new_tokens=max_new), version=version)
            for i in range(n)]


def test_version_tagged_requests_join_the_hosted_version_or_wait_for_staged(engine,
                                                                           tiny_model_dir):
    """DORA's worker contract: staged weights do not evict the hosted version while requests of
    it still arrive (migration, legacy fill); a request for the staged version waits for the
    running ones to drain and then runs on it; a request for a version that is gone comes back
    "refused", untouched."""
    async def scenario():
        old = asyncio.create_task(_collect(engine, _versioned(2, 0, max_new=60)))
        await _until_generated(engine, 10)
        await engine.load_weights(1, _shifted_weights(tiny_model_dir, 1))
        assert engine.stats().staged_version == 1 and engine.version == 0
        joined = await _collect(engine, _versioned(2, 0, max_new=5, prefix="late"))
        newer = asyncio.create_task(_collect(engine, _versioned(2, 1, max_new=5)))
        first = await old
        return first, joined, await newer

    first, joined, newer = asyncio.run(scenario())
    assert all(set(r.versions) == {0} for r in first + joined)  # joined on version 0
    assert all(set(r.versions) == {1} for r in newer) and engine.version == 1
    refused = asyncio.run(_collect(engine, _versioned(2, 0)))  # version 0's weights are gone
    assert [r.finish_reason for r in refused] == ["refused"] * 2
    assert all(not r.finished and r.token_ids == [] for r in refused)
    with pytest.raises(ValueError, match="needs version 2.*nothing staged"):
        asyncio.run(_collect(engine, _versioned(1, 2)))
    with pytest.raises(ValueError, match="mixes versions"):
        asyncio.run(_collect(engine, _versioned(1, 1) + _versioned(1, 2)))


def test_configure_changes_batch_size_and_partial_rollout_while_running(engine,
                                                                       tiny_model_dir):
    """The adaptive scheduler's plans: a smaller batch from the next chunk on; switching
    partial rollout on applies weights that were waiting for running requests to drain."""
    # read from disk before the requests start: on a loaded machine, reading them while the
    # requests ran let vLLM finish both first, and nothing was left to delay the weights for
    weights = _shifted_weights(tiny_model_dir, 1)

    async def scenario():
        task = asyncio.create_task(_collect(engine, _requests(2, max_new=80)))
        await _until_generated(engine, 10)
        await engine.load_weights(1, weights)
        assert engine.stats().staged_version == 1  # delayed: requests still running
        engine.configure(partial_rollout=True, max_batch_size=2)
        assert engine.version == 1 and engine.stats().staged_version is None
        return await task

    results = asyncio.run(scenario())
    assert all(r.versions[0] == 0 and r.versions[-1] == 1 for r in results)  # per-token tags
    assert engine.max_batch_size == 2
    with pytest.raises(ValueError, match="max_batch_size = 0"):
        engine.configure(max_batch_size=0)


def test_a_chunk_whose_requests_were_all_aborted_before_starting_yields_their_aborts(engine):
    """Migration can abort every request of a call still queued behind another batch."""
    async def scenario():
        running = asyncio.create_task(_collect(engine, _requests(1, max_new=60)))
        await asyncio.sleep(0)
        queued = [GenerationRequest(f"q{i}", [1, 2, 3], SamplingParams(max_new_tokens=5))
                  for i in range(2)]
        await engine.abort([r.request_id for r in queued])
        aborted = await _collect(engine, queued)
        return aborted, await running

    aborted, running = asyncio.run(scenario())
    assert [r.finish_reason for r in aborted] == ["abort", "abort"]
    assert running[0].finished


def test_progress_is_reported_at_the_requested_lengths_as_snapshots(engine):
    fresh = GenerationRequest("f", [1, 35, 33], SamplingParams(max_new_tokens=8),
                              report_at=(3, 5, 20))
    first = asyncio.run(_collect(engine, [fresh]))
    assert [(r.finish_reason, len(r.token_ids)) for r in first] == [
        ("progress", 3), ("progress", 5), ("length", 8)]
    assert [r.final for r in first] == [False, False, True]
    assert first[0].token_ids == first[-1].token_ids[:3]  # a copy: it did not grow with the row
    assert engine.stats().running == 0
    # resumed with 4 tokens: the milestone at 3 was passed elsewhere and is not reported again
    resumed = GenerationRequest("r", [1, 35, 33], SamplingParams(max_new_tokens=8),
                                resume_ids=first[-1].token_ids[:4],
                                resume_logprobs=first[-1].logprobs[:4],
                                resume_versions=[0] * 4, report_at=(3, 5))
    again = asyncio.run(_collect(engine, [resumed]))
    assert [(r.finish_reason, len(r.token_ids)) for r in again] == [("progress", 5),
                                                                     ("length", 8)]


@pytest.mark.parametrize("start", ["fresh", "resumed"])
def test_stop_strings_end_at_the_token_that_completes_them(engine, tiny_model_dir, start):
    """A stop string the tokenizer spells in two tokens ends the request ("stop") at the token
    that completes it; the tokens are the ones sampled (greedy: a prefix of the run without
    stops) with their log-probs. Only text generated since the request (re)started counts: a
    transcript that resumes after an earlier turn's stop string is not stopped by it again."""
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(tiny_model_dir).decode
    free = asyncio.run(_collect(engine, _requests(4, max_new=30, temperature=0.0)))
    # the first output that changes character: its first two different characters
    r, k = next((r, k) for r in free for k in range(len(r.token_ids) - 1)
                if decode(r.token_ids[k:k + 1]) != decode(r.token_ids[k + 1:k + 2]))
    stop = decode(r.token_ids[k:k + 2])
    sampling = SamplingParams(max_new_tokens=len(r.token_ids), temperature=0.0,
                              stop_strings=(stop, "@@"))
    request = GenerationRequest("s", r.prompt_ids, sampling)
    if start == "resumed":  # the history already holds the stop string, and more after it
        head = k + 3
        request = GenerationRequest("s", r.prompt_ids, sampling, resume_ids=r.token_ids[:head],
                                    resume_logprobs=r.logprobs[:head],
                                    resume_versions=[0] * head)
    out = asyncio.run(_collect(engine, [request]))[0]
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions)
    assert out.token_ids == r.token_ids[:len(out.token_ids)]  # exactly what was sampled
    torch.testing.assert_close(torch.tensor(out.logprobs),
                               torch.tensor(r.logprobs[:len(out.logprobs)]))
    if start == "fresh":
        assert out.finish_reason == "stop" and len(out.token_ids) == k + 2
        assert stop in decode(out.token_ids) and stop not in decode(out.token_ids[:-1])
    else:  # where the free run's text after `head` first holds the string, if anywhere
        end = next((j + 1 for j in range(head, len(r.token_ids))
                    if stop in decode(r.token_ids[head:j + 1])), None)
        assert (out.finish_reason, len(out.token_ids)) == \
            (("stop", end) if end else ("length", len(r.token_ids)))


def test_held_weights_wait_on_an_idle_engine_until_a_newer_request(engine, tiny_model_dir):
    """`hold`: requests of the hosted version will come back (episodes between turns), so an
    idle engine stages the new weights instead of applying them; a request of the hosted
    version still runs on it, and the first request of the new one switches the engine."""
    hosted = engine.version  # the vllm engine is shared by the tests: whatever it hosts now
    asyncio.run(engine.load_weights(hosted + 1, _shifted_weights(tiny_model_dir, 3), hold=True))
    assert engine.version == hosted and engine.stats().staged_version == hosted + 1
    same = asyncio.run(_collect(engine, _versioned(2, hosted, max_new=5, prefix="kept")))
    assert all(set(r.versions) == {hosted} for r in same) and engine.version == hosted
    newer = asyncio.run(_collect(engine, _versioned(2, hosted + 1, max_new=5)))
    assert all(set(r.versions) == {hosted + 1} for r in newer)
    assert engine.version == hosted + 1 and engine.stats().staged_version is None


def test_held_weights_give_back_the_newest_weights_under_the_trainers_names(engine,
                                                                         tiny_model_dir):
    """What a trainer rebuilt without buddy copies starts from (published_rebuild.py): the
    newest weights, staged ones included, whole, on the host, under the names the trainer
    sends (its model's state_dict keys), equal to what was loaded in the engine's dtype."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(5)
    with torch.no_grad():  # each parameter once: a tied weight stays one tensor, as trained
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    loaded = {name: t.clone() for name, t in model.state_dict().items()}
    names = set(loaded)
    hosted = engine.version
    asyncio.run(engine.load_weights(hosted + 1, [loaded], hold=True))  # staged, not applied
    assert engine.version == hosted
    version, held = asyncio.run(engine.held_weights())
    assert version == hosted + 1 and set(held) == names
    for name, tensor in held.items():
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor, loaded[name].to(tensor.dtype)), name  # exact: same dtype
    asyncio.run(_collect(engine, _versioned(1, hosted + 1, max_new=2, prefix="apply")))
    assert engine.version == hosted + 1  # applied now: the same weights, hosted
    version, hosted_weights = asyncio.run(engine.held_weights())
    assert version == hosted + 1
    assert all(torch.equal(hosted_weights[n], held[n]) for n in names)


def test_a_resumed_request_whose_staged_version_was_superseded_while_it_waited_is_refused(
        engine, tiny_model_dir):
    """Two publishes while a request for the first one waits behind running work: a fresh
    waiter starts on the newest weights (the rollout relabels it); a resumed one carries tokens
    of the version it asked for, and the newest weights continuing them would mix two versions
    in one trajectory (C1), so it comes back "refused" with its history untouched (the rollout
    restarts it; nothing is lost)."""
    hosted = engine.version  # the vllm engine is shared by the tests: whatever it hosts now
    engine.configure(partial_rollout=False)
    history = [7, 8]

    async def scenario():
        # Greedy and long: the running work is still there at the second publish, until the
        # test aborts it (the engines' speed decides nothing).
        running = [GenerationRequest(f"old-{i}", [1, 2, 3 + i],
                                     SamplingParams(max_new_tokens=120, temperature=0.0),
                                     version=hosted) for i in range(2)]
        old = asyncio.create_task(_collect(engine, running))
        await _until_generated(engine, 10)
        await engine.load_weights(hosted + 1, _shifted_weights(tiny_model_dir, 1))
        resumed = GenerationRequest("moved-0", [1, 2, 3], SamplingParams(max_new_tokens=8),
                                    version=hosted + 1, resume_ids=history,
                                    resume_logprobs=[-1.0, -1.0],
                                    resume_versions=[hosted + 1] * 2)
        waiting = [asyncio.create_task(_collect(engine, [resumed])),
                   asyncio.create_task(_collect(engine, _versioned(1, hosted + 1, max_new=5)))]
        await _until_generated(engine, 5)  # both asked and were told to wait
        assert engine.version == hosted and engine.stats().staged_version == hosted + 1
        await engine.load_weights(hosted + 2, _shifted_weights(tiny_model_dir, 2))
        assert engine.stats().running == 2  # the waiters have not started
        await engine.abort([r.request_id for r in running])
        first = await old
        return first, [await task for task in waiting]

    first, (moved, fresh) = asyncio.run(scenario())
    assert [r.finish_reason for r in first] == ["abort"] * 2
    assert all(set(r.versions) == {hosted} for r in first)
    assert engine.version == hosted + 2
    (moved,) = moved
    assert moved.finish_reason == "refused" and moved.token_ids == history
    assert moved.versions == [hosted + 1] * 2
    assert all(set(r.versions) == {hosted + 2} for r in fresh)

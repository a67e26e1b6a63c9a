"""The `hf` engine's fast decode path pinned to the straightforward one.

The engine prefills each distinct prompt once and copies its cache to the prompt's samples,
writes keys and values into buffers sized at prefill (kv_cache.py), and lets finished rows ride
along in the batch until they are a quarter of it. None of that may change what a request gets:
- every reported log-prob equals a plain full forward over the request's prompt and tokens
  (no cache, one row at a time), and a greedy row's every token is that forward's argmax;
- the same seed gives the same tokens whether rows leave the batch at once or never;
- the lean decode step gives the tokens and log-probs transformers' forward gives.
The buffered cache against transformers' `DynamicLayer`: test_kv_cache_buffers.py.
"""

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import eddyrl.engines.inference.hf as hf
from eddyrl.hal import get_platform
from eddyrl.protocol import GenerationRequest, SamplingParams


def _mixed_requests(seed: int) -> list[GenerationRequest]:
    """Groups of identical prompts (shared prefill) beside lone ones, of different lengths,
    with different token budgets (rows finish at different steps), greedy and sampled rows,
    and a resumed request (prompt + earlier tokens prefill together)."""
    rng = random.Random(seed)
    requests = []
    for g in range(5):
        prompt = [1] + [rng.randrange(5, 40) for _ in range(rng.randrange(2, 9))]
        for s in range(rng.choice([1, 4, 6])):
            temperature = 0.0 if (g + s) % 3 == 0 else 1.0
            requests.append(GenerationRequest(
                f"g{g}.{s}", list(prompt),
                SamplingParams(max_new_tokens=rng.randrange(3, 20), temperature=temperature)))
    requests.append(GenerationRequest(
        "resumed", [1, 12, 13], SamplingParams(max_new_tokens=15, temperature=1.0),
        resume_ids=[20, 21, 22], resume_logprobs=[-1.0, -1.0, -1.0], resume_versions=[0, 0, 0]))
    return requests


def _generate(model_dir, requests, dead_rows=None, monkeypatch=None):
    if dead_rows is not None:
        monkeypatch.setattr(hf, "DEAD_ROWS_BEFORE_COMPACTION", dead_rows)
    engine = hf.HFInferenceEngine(model_dir, get_platform("cpu"), seed=11)

    async def run():
        return {r.request_id: r async for r in engine.generate(requests) if r.final}
    return asyncio.run(run())


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_decode_reports_the_plain_forwards_logprobs_and_greedy_tokens(tiny_model_dir, seed):
    requests = _mixed_requests(seed)
    results = _generate(tiny_model_dir, requests)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    checked = 0
    for request in requests:
        r = results[request.request_id]
        assert len(r.token_ids) == len(r.logprobs) <= request.sampling.max_new_tokens
        ids = torch.tensor([r.prompt_ids + r.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        start = len(r.prompt_ids) + len(request.resume_ids)  # generated here, not resumed
        fresh = torch.tensor(r.token_ids[len(request.resume_ids):])
        expected = logp[start - 1:].gather(-1, fresh[:, None]).squeeze(-1)
        reported = torch.tensor(r.logprobs[len(request.resume_ids):])
        assert (expected - reported).abs().max().item() < 1e-5, request.request_id
        if request.sampling.temperature == 0:
            assert torch.equal(logp[start - 1:].argmax(-1), fresh), request.request_id
        checked += len(fresh)
    assert checked > 100


def test_when_finished_rows_leave_the_batch_does_not_change_any_token(tiny_model_dir,
                                                                       monkeypatch):
    """At once (0), at a quarter (the default) or only when all finished (1): the same seed
    samples the same tokens with the same log-probs."""
    requests = _mixed_requests(2)
    runs = [_generate(tiny_model_dir, requests, f, monkeypatch) for f in (0.0, 0.25, 1.0)]
    for other in runs[1:]:
        assert other.keys() == runs[0].keys()
        for rid, r in runs[0].items():
            assert other[rid].token_ids == r.token_ids, rid
            assert other[rid].logprobs == pytest.approx(r.logprobs, abs=1e-6), rid


def test_the_lean_decode_step_is_used_and_samples_what_transformers_forward_samples(
        tiny_model_dir):
    """lean_decode.py: on the tiny Qwen3 the engine decodes op by op; with transformers'
    forward instead, the same seed gives the same tokens and log-probs."""
    requests = _mixed_requests(3)
    lean = hf.HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=11)
    plain = hf.HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=11)
    assert lean._lean is not None
    plain._lean = None

    async def run(engine):
        return {r.request_id: r async for r in engine.generate(requests) if r.final}
    got, want = asyncio.run(run(lean)), asyncio.run(run(plain))
    for rid, r in want.items():
        assert got[rid].token_ids == r.token_ids, rid
        assert got[rid].logprobs == pytest.approx(r.logprobs, abs=1e-6), rid


def test_the_lean_decoder_refuses_what_it_does_not_reproduce(tiny_model_dir, monkeypatch,
                                                              caplog):
    from eddyrl.engines.inference.lean_decode import LeanDecoder

    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert LeanDecoder.for_model(eager) is None  # its masks are additive, not SDPA's
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "linear"}
    assert LeanDecoder.for_model(model) is None
    # a decoder that computes something else fails the start-up check: transformers' forward
    monkeypatch.setattr(LeanDecoder, "_rotate_half", staticmethod(lambda x: x))
    engine = hf.HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=0)
    assert engine._lean is None
    assert "differs from transformers' forward" in caplog.text

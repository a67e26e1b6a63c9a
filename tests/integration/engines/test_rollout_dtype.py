"""`rollout.dtype` and the run's longest sequence reach the `hf` engine the way the runtime
builds it (a rollout worker, minus Ray), and bf16 decoding is pinned to float32's on the tiny
model: the same greedy tokens, log-probs within 0.05 (measured: at most 0.006 over 8 x 30
tokens). The `vllm` engine's side is in test_vllm_engine.py."""

import asyncio

import pytest
import torch

from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.hal import get_platform
from eddyrl.protocol import GenerationRequest, SamplingParams

LOGPROB_TOLERANCE = 0.05


def _greedy(n: int, max_new: int = 30) -> list[GenerationRequest]:
    return [GenerationRequest(f"g{i}", [1, 35, 33, 19, 5 + i], SamplingParams(
        max_new_tokens=max_new, temperature=0.0, stop_token_ids=(2,))) for i in range(n)]


def _generate(engine, requests) -> dict:
    async def run():
        return {r.request_id: r async for r in engine.generate(requests) if r.final}
    return asyncio.run(run())


def test_bf16_decodes_as_float32_does(tiny_model_dir):
    full = HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=3)
    half = HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=3, dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    expected, got = _generate(full, _greedy(8)), _generate(half, _greedy(8))
    for rid, result in got.items():
        assert result.token_ids == expected[rid].token_ids
        assert max(abs(a - b) for a, b in zip(result.logprobs, expected[rid].logprobs)) \
            < LOGPROB_TOLERANCE


def test_the_runs_longest_sequence_bounds_requests(tiny_model_dir):
    engine = HFInferenceEngine(tiny_model_dir, get_platform("cpu"), max_model_len=20)
    assert engine.max_positions == 20
    with pytest.raises(ValueError, match="exceeds the model's 20 positions"):
        _generate(engine, _greedy(1, max_new=16))
    with pytest.raises(ValueError, match="grows with the batch"):
        HFInferenceEngine(tiny_model_dir, get_platform("cpu"), memory_fraction=0.9)


def test_a_rollout_worker_builds_its_engine_from_the_rollout_settings(monkeypatch,
                                                                      tiny_model_dir):
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime import rollout_worker

    config = load_config(overrides=[f"model.path={tiny_model_dir}", "platform=cpu",
                                    "rollout.engine=hf", "rollout.dtype=bf16",
                                    "data.max_prompt_tokens=24", "rollout.max_new_tokens=16"])
    for key in get_platform("cpu").inference_engine_env():
        monkeypatch.setenv(key, "")  # recorded, so the worker's values are undone after
    threads = torch.get_num_threads()
    try:
        worker = rollout_worker.RolloutWorker(runtime_settings(config).rollout, 0, tiny_model_dir)
    finally:
        torch.set_num_threads(threads)
    assert next(worker.engine.model.parameters()).dtype == torch.bfloat16
    assert worker.engine.max_positions == 40

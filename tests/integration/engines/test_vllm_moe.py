"""The `vllm` engine on the tiny mixture of experts, on the CPU: vLLM's CPU build serves it with
greedy tokens and log-probs equal to the `hf` engine's (max abs difference below 1e-4, as
test_vllm_engine.py) at the start and after weight updates in the trainer's names (fused
experts split into the checkpoint's per-expert matrices, the CPU experts repacked after the
reload: engines/inference/vllm/expert_weights.py). Without the repack the updated engine
drifts from hf (measured up to 0.4 in log-prob): the second update here checks it is
repacked once per update, not only once."""

import asyncio

import pytest
import torch
from vllm_marks import needs_vllm

from eddyrl.engines.inference.base import WeightsNotHeld
from eddyrl.hal import get_platform
from eddyrl.protocol import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from eddyrl.models.tiny import build_tokenizer
    from eddyrl.models.tiny_moe import build_tiny_moe_model

    path = str(tmp_path_factory.mktemp("moe"))
    tokenizer = build_tokenizer()
    build_tiny_moe_model(tokenizer, 0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _greedy(engine):
    requests = [GenerationRequest(f"g{i}", [1, 35, 33, 19, 5 + i], SamplingParams(
        max_new_tokens=20, temperature=0.0, stop_token_ids=(2,))) for i in range(6)]

    async def run():
        return sorted([r async for r in engine.generate(requests)], key=lambda r: r.request_id)
    return asyncio.run(run())


def _assert_same(ours, theirs):
    assert [r.token_ids for r in ours] == [r.token_ids for r in theirs]
    diff = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs))
    assert diff < 1e-4, f"max |hf - vllm| log-prob = {diff:.2e}"


@needs_vllm
def test_vllm_serves_the_moe_as_hf_does_before_and_after_weight_updates(moe_dir):
    from transformers import AutoModelForCausalLM

    from eddyrl.engines.inference.hf import HFInferenceEngine
    from eddyrl.engines.inference.vllm.engine import VLLMInferenceEngine

    hf = HFInferenceEngine(moe_dir, get_platform("cpu"))
    engine = VLLMInferenceEngine(moe_dir, get_platform("cpu"), seed=3)
    try:
        before = _greedy(engine)
        _assert_same(_greedy(hf), before)
        weights = AutoModelForCausalLM.from_pretrained(moe_dir).state_dict()
        assert "model.layers.0.mlp.experts.gate_up_proj" in weights  # the trainer's names
        torch.manual_seed(7)
        for version in (1, 2):
            new = {k: v + 0.05 * torch.randn_like(v) for k, v in weights.items()}
            names = list(new)
            for e in (hf, engine):
                asyncio.run(e.load_weights(version, [{k: new[k] for k in names[i:i + 9]}
                                                     for i in range(0, len(names), 9)]))
            after = _greedy(engine)
            assert all(set(r.versions) == {version} for r in after)
            _assert_same(_greedy(hf), after)
        assert [r.token_ids for r in after] != [r.token_ids for r in before]  # it did change
        # the weights given back (a trainer rebuilt without buddy copies): vLLM's experts
        # kernels keep the hosted experts in layouts of their own, so those are refused; a
        # staged update's come back whole, under the trainer's names
        with pytest.raises(WeightsNotHeld, match="experts"):
            asyncio.run(engine.held_weights())
        asyncio.run(engine.load_weights(3, [new], hold=True))
        version, held = asyncio.run(engine.held_weights())
        assert version == 3 and set(held) == set(weights)
    finally:
        engine.close()


@needs_vllm
@pytest.mark.slow
def test_eddy_train_moe_tiny_on_vllm_keeps_rollout_and_trainer_log_probs_equal(moe_dir,
                                                                               tmp_path):
    """Two steps, so that the second step's rollouts come from updated weights: its per-token
    mismatch on trained tokens stays within the engines' tolerance."""
    import json

    from eddyrl.config import load_config
    from eddyrl.launch import train

    run_dir = tmp_path / "run"
    config = load_config("moe_tiny", overrides=[
        f"model.path={moe_dir}", f"run_dir={run_dir}", "rollout.engine=vllm", "loop.steps=2",
        "loop.batch_prompts=4", "loop.eval_every=0", "rollout.n_samples=4",
        "rollout.max_new_tokens=16", "data.train_size=32", "data.eval_size=4",
        "cluster.threads_per_worker=1", "data.reward_fn=reward_fixtures:length_reward",
        "algorithm.dynamic_sampling=false"])
    train(config)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()][1:]
    assert len(steps) == 2
    assert all(step["mismatch_abs_max"] < 1e-4 for step in steps), \
        [step["mismatch_abs_max"] for step in steps]

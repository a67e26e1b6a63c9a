"""What only the `vllm` engine needs checked: it agrees with `hf` token for token after a weight
update, its log-prob semantics with top-k / top-p, its view of vLLM's API, its dtype and
context, and its KV cache sized exactly or as a share of the device. The contract itself is
test_engine_contract.py (both engines); the parts checked without vLLM (weight packing,
vLLM not installed): test_vllm_engine_parts.py."""

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_marks import needs_vllm

from eddyrl.hal import get_platform
from eddyrl.protocol import GenerationRequest, SamplingParams


async def _collect(engine, requests):
    return [r async for r in engine.generate(requests)]


def _greedy(n, max_new=40):
    return [GenerationRequest(f"g{i}", [1, 35, 33, 19, 5 + i], SamplingParams(
        max_new_tokens=max_new, temperature=0.0, stop_token_ids=(2,))) for i in range(n)]


@pytest.fixture()
def vllm(vllm_engine, initial_weights):
    vllm_engine.configure(partial_rollout=False, max_batch_size=256)
    asyncio.run(vllm_engine.load_weights(0, [initial_weights]))
    return vllm_engine


@needs_vllm
def test_greedy_outputs_equal_hf_after_load_weights(vllm, tiny_model_dir):
    from eddyrl.engines.inference.hf import HFInferenceEngine

    hf = HFInferenceEngine(tiny_model_dir, get_platform("cpu"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(7)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    names = list(new)
    for engine in (hf, vllm):
        buckets = [{k: new[k] for k in names[i:i + 7]} for i in range(0, len(names), 7)]
        asyncio.run(engine.load_weights(3, buckets))
    ours, theirs = (sorted(asyncio.run(_collect(e, _greedy(8))), key=lambda r: r.request_id)
                    for e in (hf, vllm))
    assert [r.token_ids for r in ours] == [r.token_ids for r in theirs]
    assert all(set(r.versions) == {3} for r in theirs)
    diff = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs))
    assert diff < 1e-4


@needs_vllm
def test_held_weights_are_the_loaded_ones_under_the_trainers_names(vllm, tiny_model_dir,
                                                                   monkeypatch):
    """`held_weights` reads vLLM's model back (weights_back.py): after an update to version 3,
    exactly the names the trainer sends (the HF state dict's, the tied head included), each
    equal to what was loaded (fp32 update, fp32 engine: exact; the CPU backend's linear
    weights come back through its GEMM on the identity). An update staged but held comes back
    as the newest, in the engine's dtype (sent in bf16: the same values in fp32). A name the
    model cannot give is refused, naming it."""
    from eddyrl.engines.inference.base import WeightsNotHeld

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(11)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied: one tensor, as exported
    asyncio.run(vllm.load_weights(3, [new]))
    version, held = asyncio.run(vllm.held_weights())
    assert version == vllm.version == 3
    assert set(held) == set(model.state_dict())
    for name, tensor in new.items():
        assert held[name].device.type == "cpu" and held[name].dtype == torch.float32
        assert torch.equal(held[name], tensor), name

    staged = {k: (v - 0.02).to(torch.bfloat16) for k, v in new.items()}
    asyncio.run(vllm.load_weights(4, [staged], hold=True))
    version, held = asyncio.run(vllm.held_weights())
    assert (version, vllm.version) == (4, 3)  # staged, not applied
    assert all(torch.equal(held[k], v.float()) for k, v in staged.items())

    monkeypatch.setattr(vllm, "_known_names", vllm._known_names | {"model.extra.weight"})
    with pytest.raises(WeightsNotHeld, match=r"lacks weights the trainer sends: "
                                             r"\['model.extra.weight'\]"):
        asyncio.run(vllm.held_weights())


@needs_vllm
def test_top_k_log_probs_are_renormalised_over_the_kept_tokens(vllm, tiny_model_dir):
    """vLLM's processed log-probs: log_softmax(logits / T) restricted to the top-k tokens and
    renormalised over them (hf does not renormalise; see vllm.py)."""
    request = GenerationRequest("k", [1, 35, 33, 19], SamplingParams(
        max_new_tokens=12, temperature=0.8, top_k=5, seed=1))
    result = asyncio.run(_collect(vllm, [request]))[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([result.prompt_ids + result.token_ids])).logits[0, :-1]
    logp = torch.log_softmax(logits[len(result.prompt_ids) - 1:] / 0.8, -1)
    top = logp.topk(5, -1).values
    kept = top.logsumexp(-1)
    chosen = logp.gather(-1, torch.tensor(result.token_ids)[:, None]).squeeze(-1)
    assert (chosen[:, None] >= top[:, -1:] - 1e-5).all()  # drawn from the top 5
    torch.testing.assert_close(torch.tensor(result.logprobs), chosen - kept, atol=1e-4, rtol=0)


@needs_vllm
def test_stats_show_the_kv_cache_in_use_while_generating(vllm):
    async def scenario():
        task = asyncio.create_task(_collect(vllm, _greedy(4, max_new=150)))
        seen = 0.0
        while not task.done():
            seen = max(seen, vllm.stats().kv_cache_usage)
            await asyncio.sleep(0.005)
        await task
        return seen

    assert 0 < asyncio.run(scenario()) <= 1


@needs_vllm
def test_engine_args_leave_out_what_the_installed_vllm_lacks_but_not_what_is_required():
    from eddyrl.engines.inference.vllm.api import VLLMApi

    api = VLLMApi.detect(get_platform("cpu"))
    older = VLLMApi(version="older", sleep_supported=False,
                    engine_arg_names=api.engine_arg_names - {"kv_cache_memory_bytes"})
    args = older.engine_args(model="m", kv_cache_memory_bytes=1 << 20)
    assert args.model == "m" and args.kv_cache_memory_bytes is None
    oldest = VLLMApi(version="oldest", sleep_supported=False,
                     engine_arg_names=api.engine_arg_names - {"logprobs_mode"})
    with pytest.raises(RuntimeError, match="logprobs_mode"):
        oldest.engine_args(model="m", logprobs_mode="processed_logprobs")


@needs_vllm
def test_vllm_starts_in_the_runs_dtype_and_context(tiny_model_dir, vllm):
    """`rollout.dtype` bf16 and the run's longest sequence as vLLM's context: its weights and
    KV cache in bf16, sized for max_batch_size sequences of that length; a longer request is
    refused; greedy outputs match the float32 engine's on the tiny model; its weights come
    back (`held_weights`) as the checkpoint's cast to bf16, exactly."""
    from eddyrl.engines.inference.vllm.api import kv_cache_bytes_for
    from eddyrl.engines.inference.vllm.engine import VLLMInferenceEngine

    engine = VLLMInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=3, max_batch_size=4,
                                 dtype="bfloat16", max_model_len=64)
    try:
        config = engine._llm.vllm_config
        assert config.model_config.max_model_len == engine.max_positions == 64
        assert config.model_config.dtype == torch.bfloat16
        model_json = json.loads((Path(tiny_model_dir) / "config.json").read_text())
        assert config.cache_config.kv_cache_memory_bytes == kv_cache_bytes_for(model_json, 4,
                                                                               64, 2)
        requests = _greedy(4, max_new=30)
        half = asyncio.run(_collect(engine, requests))
        full = asyncio.run(_collect(vllm, _greedy(4, max_new=30)))
        by_id = {r.request_id: r for r in full}
        for result in half:
            assert result.token_ids == by_id[result.request_id].token_ids
            assert max(abs(a - b) for a, b in zip(
                result.logprobs, by_id[result.request_id].logprobs)) < 0.05
        version, held = asyncio.run(engine.held_weights())
        checkpoint = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        assert version == 0 and set(held) == set(checkpoint)
        assert all(torch.equal(held[k], v.to(torch.bfloat16)) for k, v in checkpoint.items())
        too_long = GenerationRequest("long", [1] * 40, SamplingParams(max_new_tokens=30))
        with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
            asyncio.run(_collect(engine, [too_long]))
    finally:
        engine.close()


@pytest.mark.integration  # pure arithmetic, but its module imports vLLM (and Ray): seconds
@needs_vllm
def test_the_kv_cache_is_sized_exactly_or_as_a_share_of_the_device():
    """`rollout.memory_fraction` 0: exactly max_batch_size sequences of the context (vLLM
    then ignores its utilization); else the share, with no exact size to override it."""
    from eddyrl.engines.inference.vllm.api import kv_cache_args, kv_cache_bytes_for

    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 64}
    assert kv_cache_args(config, 8, 300, 2) == {
        "kv_cache_memory_bytes": kv_cache_bytes_for(config, 8, 300, 2)}
    assert kv_cache_bytes_for(config, 8, 300, 2) == 8 * 512 * (2 * 2 * 2 * 16 * 2)
    assert kv_cache_args(config, 8, 300, 2, memory_fraction=0.85) == {
        "gpu_memory_utilization": 0.85}

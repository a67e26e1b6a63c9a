"""The tiny mixture of experts (eddyrl/models/tiny_moe.py) and the engines that run it: it
builds with the intended shape (every layer sparse, 4 experts, top-2, the memory plan's
parameter count exact and the active count the dense tiny model's plus the routers); the `hf`
engine's log-probs equal the FSDP trainer's on the same weights (fp32 on the CPU: max abs
difference below 1e-4, as test_logprob_agreement.py); `eddy train moe_tiny` runs two steps on
hf rollout and the FSDP trainer and changes the experts' weights; the trainer's step, each MoE
layer sharded and checkpointed or not, is the straightforward one; the bundled warm start and
`eddy sft --experts` make this model."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3MoeForCausalLM

from eddyrl.core.batching import build_train_batch
from eddyrl.engines.registry import load_engine_class
from eddyrl.hal import get_platform
from eddyrl.models.tiny import TinyModelConfig, build_tiny_model, build_tokenizer
from eddyrl.models.tiny_moe import MOE_WARMSTART_DIR, TinyMoeConfig, build_tiny_moe_model
from eddyrl.plan.shapes import shape_from_config
from eddyrl.protocol import GenerationRequest, Group, SamplingParams, Trajectory


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe"))
    tokenizer = build_tokenizer()
    build_tiny_moe_model(tokenizer, 0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_tiny_moe_has_the_intended_shape():
    tokenizer = build_tokenizer()
    model = build_tiny_moe_model(tokenizer, 0)
    assert isinstance(model, Qwen3MoeForCausalLM)
    layers = model.model.layers
    assert len(layers) == 4
    for layer in layers:  # every layer sparse: a router over 4 experts, 2 per token
        assert type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
        assert layer.mlp.gate.weight.shape == (4, 128)
        assert layer.mlp.gate.top_k == 2 and layer.mlp.gate.norm_topk_prob
        assert layer.mlp.experts.gate_up_proj.shape == (4, 2 * 192, 128)
        assert layer.mlp.experts.down_proj.shape == (4, 128, 192)
    assert model.config.head_dim == 32 and model.config.tie_word_embeddings
    assert not model.config.output_router_logits  # no router loss in RL's forwards
    count = sum(p.numel() for p in model.parameters())
    shape = shape_from_config(model.config.to_dict())
    assert shape.parameters() == count == 1_452_160
    # two active experts of half the dense MLP's width: the dense model's work per token
    dense = sum(p.numel() for p in build_tiny_model(tokenizer, 0).parameters())
    assert shape.active_parameters() == dense + 4 * 4 * 128  # + the routers


def test_of_size_refuses_fewer_experts_than_are_routed():
    assert TinyMoeConfig.of_size(num_experts=8).moe_intermediate_size == 192
    assert TinyMoeConfig.of_size(64, 2, 40).moe_intermediate_size == 40
    with pytest.raises(ValueError, match="experts 1: must be >= 2"):
        TinyMoeConfig.of_size(num_experts=1)


def _sampled_batch(engine, tokenizer, temperature):
    groups = []
    for i, text in enumerate(["add 1 2", "add 9 9 9 9", "add 3"]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_dict=False)
        group = Group(f"g{i}", text, "0", list(ids), 0)
        requests = [GenerationRequest(f"g{i}-{k}", list(ids), SamplingParams(
            max_new_tokens=16 + 7 * k, temperature=temperature)) for k in range(3)]

        async def run(reqs=requests):
            return [r async for r in engine.generate(reqs)]

        for result in sorted(asyncio.run(run()), key=lambda r: r.request_id):
            group.trajectories.append(Trajectory(result, float(len(result.token_ids) % 2)))
        groups.append(group)
    return build_train_batch(groups, tokenizer.pad_token_id)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_and_fsdp_logprobs_agree_on_the_moe(moe_dir, tmp_path, temperature):
    from eddyrl.engines.inference.hf import HFInferenceEngine

    platform = get_platform("cpu")
    engine = HFInferenceEngine(moe_dir, platform, seed=3)
    batch = _sampled_batch(engine, AutoTokenizer.from_pretrained(moe_dir), temperature)
    trainer = load_engine_class("train", "fsdp")(
        moe_dir, platform, 0, 1, f"file://{tmp_path}/pg", micro_batch_size=4,
        temperature=temperature)
    try:
        trained = trainer.compute_logprobs(batch)
    finally:
        trainer.close()
    mask = batch.loss_mask.bool()
    diff = (trained - batch.old_logprobs)[mask].abs()
    assert mask.sum() > 50
    assert diff.max().item() < 1e-4, f"max |inference - training| = {diff.max().item():.2e}"


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_the_fsdp_trainer_shards_each_moe_layer_and_takes_the_plain_step(moe_dir, tmp_path,
                                                                         checkpointing):
    """Each Qwen3MoeDecoderLayer its own FSDP unit, activation checkpointing on it or not: the
    engine's step is the straightforward forward and backward (fsdp_helpers: 1e-5)."""
    from fsdp_helpers import assert_takes_the_plain_step, make_batch
    from torch.distributed.fsdp import FSDPModule

    from eddyrl.core.losses import make_policy_loss

    loss = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
    batch = make_batch(moe_dir)
    trainer = load_engine_class("train", "fsdp")(
        moe_dir, get_platform("cpu"), 0, 1, f"file://{tmp_path}/pg", micro_batch_size=2,
        activation_checkpointing=checkpointing)
    try:
        layers = trainer.model.model.layers
        assert len(layers) == 4 and all(isinstance(layer, FSDPModule) for layer in layers)
        got = torch.full(batch.input_ids.shape, float("nan"))
        metrics = trainer.train_step(batch, loss, logprobs_out=got)
        assert_takes_the_plain_step(moe_dir, batch, loss, metrics, got)
    finally:
        trainer.close()


@pytest.mark.slow
def test_eddy_train_moe_tiny_runs_two_steps_on_hf_and_fsdp(moe_dir, tmp_path):
    from eddyrl.config import load_config
    from eddyrl.launch import train

    run_dir = tmp_path / "run"
    config = load_config("moe_tiny", overrides=[
        f"model.path={moe_dir}", f"run_dir={run_dir}", "loop.steps=2", "loop.batch_prompts=4",
        "loop.eval_every=0", "rollout.n_samples=4", "rollout.max_new_tokens=16",
        "data.train_size=32", "data.eval_size=4", "cluster.threads_per_worker=1",
        "data.reward_fn=reward_fixtures:length_reward", "algorithm.dynamic_sampling=false"])
    assert (config.rollout.engine, config.train.engine) == ("hf", "fsdp")
    summary = json.loads(train(config).read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()][1:]
    assert len(steps) == 2 and summary["rollout_workers"] == 1
    assert all(step["tokens"] > 0 for step in steps)
    start = load_file(f"{moe_dir}/model.safetensors")
    end = load_file(str(next((run_dir / "checkpoint").glob("*.safetensors"))))
    expert = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert expert in end and not torch.equal(start[expert], end[expert])


def test_the_bundled_moe_warmstart_is_the_tiny_moe():
    from eddyrl.config import load_config

    config = load_config("moe_tiny")
    assert config.model.path == "builtin:moe_warmstart"
    assert config.model.resolve() == str(MOE_WARMSTART_DIR)
    shipped = json.loads((MOE_WARMSTART_DIR / "config.json").read_text())
    model = build_tiny_moe_model(build_tokenizer(), 0)
    assert shape_from_config(shipped) == shape_from_config(model.config.to_dict())
    assert not shipped["output_router_logits"]


def test_the_shipped_moe_warmstart_answers_some_held_out_prompts_with_every_expert_in_use():
    from transformers import AutoModelForCausalLM

    from eddyrl.tasks.arith import ArithTaskConfig, generate_rows, max_response_chars
    from eddyrl.tasks.evaluate import evaluate
    from eddyrl.tasks.prompts import prompt_ids

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(MOE_WARMSTART_DIR)
    model = AutoModelForCausalLM.from_pretrained(MOE_WARMSTART_DIR)
    assert isinstance(model, Qwen3MoeForCausalLM)
    rows = generate_rows(64, 0, "eval", ArithTaskConfig())
    accuracy = evaluate(model, tokenizer, rows, max_new_tokens=max_response_chars(
        ArithTaskConfig()) + 1, device=torch.device("cpu"))
    assert 0.0 < accuracy < 0.5  # the careless habit RL unlearns (README.md)
    # SFT's load-balancing loss kept every expert of every layer in use (README.md: 7%..45%)
    ids = torch.tensor([prompt_ids(tokenizer, rows[0]["prompt"])])
    with torch.no_grad():
        routers = model(input_ids=ids, output_router_logits=True).router_logits
    for logits in routers:
        used = torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=4)
        assert used.shape == (4,) and (used > 0).sum() >= 3


def test_eddy_sft_experts_trains_and_saves_a_moe_without_its_router_loss(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from eddyrl.cli import main

    out = tmp_path / "moe"
    assert main(["sft", "--out", str(out), "--experts", "4", "--hidden-size", "64",
                 "--layers", "1", "--steps", "3", "--batch-size", "4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["final_loss"] > 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 2 * 96, 64)
    assert not model.config.output_router_logits  # the load-balancing loss was SFT's only


def test_load_balancing_adds_the_router_loss_inside_only():
    from eddyrl.models.tiny_moe import load_balancing

    model = build_tiny_moe_model(build_tokenizer(), 0)
    ids = torch.randint(5, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = model(input_ids=ids, labels=ids)
    with load_balancing(model):
        balanced = model(input_ids=ids, labels=ids)
    assert plain.aux_loss is None and balanced.aux_loss > 0
    want = plain.loss + model.config.router_aux_loss_coef * balanced.aux_loss
    assert torch.allclose(balanced.loss, want, rtol=1e-6)
    assert not model.config.output_router_logits  # back off after it
    dense = build_tiny_model(build_tokenizer(), 0)
    with load_balancing(dense):  # a model without routers: left alone
        assert not hasattr(dense.config, "output_router_logits")

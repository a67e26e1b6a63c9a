"""Rollout routing replay on a tiny random Qwen3-MoE (tests/support/moe_model.py): the hf engine
records the experts of every input token as a plain forward routes them; resumed tokens keep
theirs; the FSDP trainer replaying them changes nothing in the same dtype, restores the
rollout's log-probs when its own routing disagrees, and still trains the router; a dense
model is refused on both sides.

Tolerances (measured on this model, fp32 everywhere): replay vs no replay in one trainer
differs by at most 1e-6 (the same formula: 0.0 measured); hf engine vs trainer log-probs by at
most 1e-5 (KV-cached decode vs one forward: 4.8e-7 measured, with or without the forced
disagreement); routing every token elsewhere moves them by more than 0.02 (0.078 measured)."""

import pytest
import torch

from eddyrl.core.batching import build_train_batch
from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.engines.inference.routing import ExpertRecorder, find_routers
from eddyrl.engines.registry import load_engine_class
from eddyrl.errors import ConfigError
from eddyrl.hal import get_platform
from eddyrl.protocol import GenerationRequest, SamplingParams
from moe_model import LAYERS, TOP_K, rollout_groups, save_tiny_moe
from vllm_marks import needs_vllm

PAD = 0
SAME_DTYPE_TOLERANCE = 1e-6
ENGINE_VS_TRAINER_TOLERANCE = 1e-5
DISAGREEMENT = 0.02


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_tiny_moe(str(tmp_path_factory.mktemp("tiny_moe")))


@pytest.fixture(scope="module")
def groups(moe_dir):
    engine = HFInferenceEngine(moe_dir, get_platform("cpu"), seed=3, record_routing=True)
    return rollout_groups(engine)


@pytest.fixture
def make_trainer(moe_dir, tmp_path):
    engine_class = load_engine_class("train", "fsdp")
    opened = []

    def build(model_dir=moe_dir, **overrides):
        kwargs = dict(lr=1e-2, micro_batch_size=4, seed=0, **overrides)
        engine = engine_class(model_dir, get_platform("cpu"), 0, 1,
                              f"file://{tmp_path}/init{len(opened)}", **kwargs)
        opened.append(engine)
        return engine

    yield build
    for engine in opened:
        engine.close()


def _plain_experts(moe_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    recorder = ExpertRecorder(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    return recorder.take(1, len(ids))[0]


def test_the_hf_engine_records_each_input_tokens_experts_as_a_plain_forward(moe_dir, groups):
    for group in groups:
        for trajectory in group.trajectories:
            result = trajectory.result
            experts = result.routed_experts.as_tensor()
            assert experts.dtype == torch.int8  # 4 experts: one byte an id
            # every token but the response's last is an input
            assert experts.shape == (len(result.prompt_ids) + len(result.token_ids) - 1,
                                     LAYERS, TOP_K)
            sequence = result.prompt_ids + result.token_ids
            plain = _plain_experts(moe_dir, sequence)[:-1]
            # as sets per token: top-k order is the router's, the same in both
            assert torch.equal(experts.long(), plain.long()), result.request_id


def test_resumed_tokens_keep_the_experts_they_came_with(moe_dir, groups):
    engine = HFInferenceEngine(moe_dir, get_platform("cpu"), seed=3, record_routing=True)
    done = groups[0].trajectories[0].result
    kept = 3
    carried = done.routed_experts.head(len(done.prompt_ids) + kept - 1)
    marked = carried.as_tensor().clone()
    marked[:, :, 0], marked[:, :, 1] = 3, 0  # not what the engine would record
    from eddyrl.engines.inference.routing import as_routed

    request = GenerationRequest(
        "resumed", done.prompt_ids, SamplingParams(max_new_tokens=8, temperature=1.0),
        resume_ids=done.token_ids[:kept], resume_logprobs=done.logprobs[:kept],
        resume_versions=done.versions[:kept], resume_experts=as_routed(marked, "b"))
    import asyncio

    async def run():
        return [r async for r in engine.generate([request]) if r.final][0]

    result = asyncio.run(run())
    experts = result.routed_experts.as_tensor()
    assert torch.equal(experts[:len(marked)], marked)
    # the last resumed token is fed here for the first time: recorded, as a plain forward
    plain = _plain_experts(moe_dir, result.prompt_ids + result.token_ids)
    assert torch.equal(experts[len(marked):].long(), plain[len(marked):-1].long())


def test_a_dense_model_is_refused_by_the_engine_and_the_trainer(tiny_model_dir, groups,
                                                                 make_trainer):
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        HFInferenceEngine(tiny_model_dir, get_platform("cpu"), record_routing=True)
    batch = build_train_batch(groups, PAD)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        make_trainer(tiny_model_dir).compute_logprobs(batch)


def _mismatch(got: torch.Tensor, batch) -> float:
    mask = batch.loss_mask.bool()
    return (got - batch.old_logprobs)[mask].abs().max().item()


def test_replay_in_the_same_dtype_changes_no_log_prob(groups, make_trainer):
    batch = build_train_batch(groups, PAD)
    assert batch.routed_experts.shape[2:] == (LAYERS, TOP_K)
    trainer = make_trainer()  # rows of a prompt share its forward: the packed layout
    replayed = trainer.compute_logprobs(batch)
    batch.routed_experts, experts = None, batch.routed_experts
    own = trainer.compute_logprobs(batch)
    assert (replayed - own).abs().max().item() <= SAME_DTYPE_TOLERANCE
    batch.routed_experts = experts
    assert _mismatch(replayed, batch) <= ENGINE_VS_TRAINER_TOLERANCE
    rows = make_trainer(share_prompts=False).compute_logprobs(batch)  # the row layout
    assert (rows - replayed).abs().max().item() <= ENGINE_VS_TRAINER_TOLERANCE


def _route_elsewhere(trainer) -> None:
    """The trainer's routers pick the experts ranked k+1.. instead of the top k (before the
    replay's hooks run): a disagreement on every token."""
    def elsewhere(module, inputs, output):
        logits = output[0]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        ranked = probs.argsort(dim=-1, descending=True)[:, module.top_k:2 * module.top_k]
        weights = probs.gather(-1, ranked)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), ranked

    for router in find_routers(trainer.model):
        router.register_forward_hook(elsewhere, prepend=True)


def test_replay_restores_the_rollouts_log_probs_when_the_trainer_routes_elsewhere(
        groups, make_trainer):
    batch = build_train_batch(groups, PAD)
    trainer = make_trainer()
    _route_elsewhere(trainer)
    replayed = trainer.compute_logprobs(batch)
    batch.routed_experts = None
    own = trainer.compute_logprobs(batch)
    assert _mismatch(own, batch) > DISAGREEMENT  # routing elsewhere changes the log-probs
    assert _mismatch(replayed, batch) <= ENGINE_VS_TRAINER_TOLERANCE


def test_replay_still_trains_the_router_through_the_gate_weights(groups, make_trainer):
    batch = build_train_batch(groups, PAD)
    trainer = make_trainer()
    router = [n for n in trainer.model.state_dict() if n.endswith("mlp.gate.weight")][0]

    def weights():
        return {k: v.clone() for bucket in trainer.export_weights(1 << 30)
                for k, v in bucket.items()}

    before = weights()[router]
    loss = lambda logprobs, micro, total: (  # noqa: E731
        -(logprobs * micro.advantages * micro.loss_mask).sum() / total, {})
    trainer.train_step(batch, loss)
    assert (weights()[router] - before).abs().max().item() > 0


def test_a_checkpointed_layers_recompute_replays_the_same_experts(groups, make_trainer):
    """Activation checkpointing reruns each layer's forward in the backward: the replayed
    experts must still be in force then, or the gradient is the other routing's."""
    batch = build_train_batch(groups, PAD)
    loss = lambda logprobs, micro, total: (  # noqa: E731
        -(logprobs * micro.advantages * micro.loss_mask).sum() / total, {})
    after = []
    for checkpointing in ("none", "full"):
        trainer = make_trainer(activation_checkpointing=checkpointing)
        _route_elsewhere(trainer)
        trainer.train_step(batch, loss)
        after.append({k: v.clone() for bucket in trainer.export_weights(1 << 30)
                      for k, v in bucket.items()})
    assert max((after[0][k] - after[1][k]).abs().max().item() for k in after[0]) <= 1e-6


@needs_vllm
def test_the_vllm_engine_refuses_routing_replay_it_cannot_record_before_starting(
        tiny_model_dir, moe_dir):
    """vLLM 0.32 returns routed experts from its Model Runner V2 only, which needs Triton:
    its CPU build has none, and refuses the MoE model with that reason (measured: started
    anyway, vLLM's config fails with "Model Runner V2 requires Triton")."""
    from eddyrl.engines.inference.vllm.api import VLLMApi
    from eddyrl.engines.inference.vllm.engine import VLLMInferenceEngine

    if VLLMApi.detect(get_platform("cpu")).has_triton:
        pytest.skip("this vLLM build has Triton: it can record (a device check)")
    with pytest.raises(ConfigError, match="needs Triton"):
        VLLMInferenceEngine(moe_dir, get_platform("cpu"), record_routing=True)
    with pytest.raises(ConfigError, match="'qwen3' has no experts"):
        VLLMInferenceEngine(tiny_model_dir, get_platform("cpu"), record_routing=True)


def test_a_local_run_with_routing_replay_trains_through_launch(moe_dir, tmp_path,
                                                               monkeypatch):
    """`rollout.routing_replay=true` from the config to the engine (recording) and through the
    store and batch to the trainer (replaying), in one process: the trainer's forwards get
    recorded experts, the run trains, and with rollout and trainer both fp32 their log-probs
    agree as closely as without replay."""
    import json

    from eddyrl.config import load_config
    from eddyrl.engines.training import routing_replay
    from eddyrl.launch import train

    replayed = []
    layout = routing_replay.layout

    def watched(micro):
        out = layout(micro)
        replayed.append(0 if out is None else int((out >= 0).all(-1).all(-1).sum()))
        return out

    monkeypatch.setattr(routing_replay, "layout", watched)

    config = load_config(overrides=[
        f"model.path={moe_dir}", f"run_dir={tmp_path}", "platform=cpu",
        "rollout.routing_replay=true", "loop.steps=2", "loop.batch_prompts=2",
        "loop.eval_every=0", "rollout.n_samples=2", "rollout.max_new_tokens=12",
        "data.train_size=16", "data.eval_size=4", "cluster.threads_per_worker=1",
        "data.reward_fn=reward_fixtures:length_reward"])
    assert json.loads(train(config).read_text())["steps"] == 2
    assert sum(replayed) > 0  # positions replayed with recorded experts
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in lines if "mismatch_abs_max" in m]
    assert trained and all(m["mismatch_abs_max"] < ENGINE_VS_TRAINER_TOLERANCE * 10
                           for m in trained)

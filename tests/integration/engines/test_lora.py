"""LoRA (`train.lora`, peft) in the FSDP engine, its weight sync and its checkpoints, on the
tiny model: only the adapter trains, a sync to the `hf` engine carries only the factors and the
engine then computes the trainer's log-probs, and a checkpoint in peft's format loads back
(resume, peft itself, `eddy eval`)."""

import asyncio
import json
import os

import pytest
import torch
from fsdp_helpers import plain_logprobs
from tests.integration.engines.test_fsdp_engine import batch, model_dir  # noqa: F401 (fixtures)

from eddyrl.core.losses import make_policy_loss
from eddyrl.engines import low_rank
from eddyrl.engines.config import LoraConfig
from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.engines.training import lora as lora_layers
from eddyrl.engines.training.fsdp import FSDPTrainEngine
from eddyrl.errors import ConfigError
from eddyrl.hal import get_platform

pytest.importorskip("peft")

LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
# rank 8 on the attention projections: 3.8 % of the tiny model's bytes per sync
LORA = LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
TOLERANCE = 1e-5  # log-probs: float summation order (a merged weight vs base + B @ A)


def _engine(model_dir, init, **overrides):
    kwargs = dict(lr=1e-2, micro_batch_size=3, seed=0, lora=LORA)
    kwargs.update(overrides)
    return FSDPTrainEngine(model_dir, get_platform("cpu"), 0, 1, f"file://{init}", **kwargs)


def _state(engine):
    return {k: v.full_tensor().clone() for k, v in engine.model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(model_dir, batch, tmp_path_factory):
    """An engine two LoRA steps in (both factors non-zero), its state before them, and a
    checkpoint saved after the first."""
    tmp = tmp_path_factory.mktemp("lora")
    engine = _engine(model_dir, tmp / "init")
    before = _state(engine)
    engine.train_step(batch, LOSS)
    engine.save(str(tmp / "ckpt"))
    after_one = _state(engine)
    engine.train_step(batch, LOSS)
    yield engine, before, after_one, str(tmp / "ckpt")
    engine.close()


def _sync(engine, receiver, version, *, low_rank_sync=True):
    buckets = list(engine.export_weights(1 << 16, low_rank=low_rank_sync))
    asyncio.run(receiver.load_weights(version, buckets))
    return sum(t.numel() * t.element_size() for b in buckets for t in b.values())


def _agree(engine, receiver, batch):
    want = engine.compute_logprobs(batch)
    with torch.no_grad():
        got = plain_logprobs(receiver.model, batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool()
    return (want - got)[real].abs().max().item()


def test_a_lora_step_changes_only_the_adapter(trained):
    engine, before, _, _ = trained
    after = _state(engine)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    adapter = {k for k in before if lora_layers.is_adapter(k)}
    assert changed and changed <= adapter  # base weights bit-identical
    assert any(".lora_B." in k for k in changed)
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    named = dict(engine.model.named_parameters())
    assert in_optimizer == {id(p) for k, p in named.items() if lora_layers.is_adapter(k)}
    assert not any(p.requires_grad for k, p in named.items() if not lora_layers.is_adapter(k))
    assert set(engine.optimizer.state) <= {named[k] for k in adapter}  # Adam state: adapter only


def test_a_sync_sends_the_factors_only_and_the_hf_engine_merges_them(trained, model_dir,
                                                                     batch):
    engine, _, _, _ = trained
    receiver = HFInferenceEngine(model_dir, get_platform("cpu"))
    sent = _sync(engine, receiver, 1)
    assert sent == engine.export_bytes(low_rank=True)
    assert sent / engine.full_sync_bytes < 0.05  # 3.8 %
    assert engine.full_sync_bytes == sum(t.numel() * t.element_size()
                                         for t in receiver.model.state_dict().values())
    assert _agree(engine, receiver, batch) < TOLERANCE
    # each version merges onto the base, not onto the previous version
    _sync(engine, receiver, 2)
    assert receiver.version == 2 and _agree(engine, receiver, batch) < TOLERANCE


def test_merged_weights_for_engines_that_take_no_factors(trained, model_dir, batch):
    engine, _, _, _ = trained
    merged = {k: v for b in engine.export_weights(1 << 30) for k, v in b.items()}
    receiver = HFInferenceEngine(model_dir, get_platform("cpu"))
    assert list(merged) == list(receiver.model.state_dict())  # HF names, every weight
    assert _sync(engine, receiver, 1, low_rank_sync=False) == engine.full_sync_bytes
    assert _agree(engine, receiver, batch) < TOLERANCE


def test_checkpoint_is_peft_format_and_resumes_the_adapter_and_its_optimizer(
        trained, model_dir, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine, _, after_one, checkpoint = trained
    files = set(os.listdir(checkpoint))
    assert {lora_layers.ADAPTER_CONFIG, lora_layers.ADAPTER_WEIGHTS} <= files
    assert not any(f.startswith("model") for f in files)  # no copy of the base weights
    assert lora_layers.adapter_base(checkpoint) == os.path.abspath(model_dir)

    # peft loads it as its own: the model after the first step
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                           checkpoint).merge_and_unload()
    resumed = _engine(model_dir, tmp_path / "init")
    try:
        resumed.load(checkpoint)
        assert resumed.version == 1
        state = _state(resumed)
        assert all(torch.equal(state[k], after_one[k]) for k in after_one)
        with torch.no_grad():
            theirs = plain_logprobs(peft_model, batch.input_ids, batch.attention_mask)
        real = batch.attention_mask.bool()
        assert (resumed.compute_logprobs(batch) - theirs)[real].abs().max() < TOLERANCE
        resumed.train_step(batch, LOSS)  # Adam's second step: the moments came back
        want = _state(engine)
        assert all(torch.equal(t, want[k]) for k, t in _state(resumed).items())
    finally:
        resumed.close()

    full = FSDPTrainEngine(model_dir, get_platform("cpu"), 0, 1,
                           f"file://{tmp_path / 'init_full'}", micro_batch_size=3)
    try:
        with pytest.raises(ConfigError, match="train.lora.rank = 0"):
            full.load(checkpoint)
    finally:
        full.close()


def test_eval_loads_a_lora_checkpoint(trained, capsys):
    from eddyrl.cli import main

    _, _, _, checkpoint = trained
    assert main(["eval", checkpoint, "data.eval_size=4", "platform=cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["eval_prompts"] == 4


def test_unknown_target_modules_are_named(model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"train.lora.target_modules.*no linear layer "
                                          r"named \['qkv'\]"):
        _engine(model_dir, tmp_path / "init", lora=LoraConfig(rank=4, target_modules=["qkv"]))
    assert low_rank.target_of("a.weight.lora_up") == "a.weight"


@pytest.mark.parametrize("rollout_engine, factors", [("hf", True), ("vllm", False)])
def test_the_trainer_rank_sends_what_its_rollout_engine_takes_and_reports_it(
        model_dir, batch, tmp_path, rollout_engine, factors):
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime.trainer_rank import TrainerRank

    config = load_config(overrides=[
        "platform=cpu", f"model.path={model_dir}", "cluster.threads_per_worker=1",
        f"rollout.engine={rollout_engine}", "train.lora.rank=8",
        "train.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"])
    rank = TrainerRank(runtime_settings(config).trainer, 0, 1, f"file://{tmp_path}/pg",
                       model_dir)
    try:
        metrics = rank.train(batch)
        names = [n for b in rank.weight_buckets() for n in b]
        assert all(low_rank.target_of(n) for n in names) == factors
        full = rank.engine.full_sync_bytes
        assert metrics["sync_bytes"] == (131072 if factors else full)  # 8 x (128 + 128) x 4 B
        assert metrics["sync_fraction"] == metrics["sync_bytes"] / full  # x 16 linears
    finally:
        rank.engine.close()


def test_lora_composes_with_checkpointing_offload_and_the_chunked_head(model_dir, batch,
                                                                       tmp_path):
    """The same two steps with activation checkpointing, everything offloaded and the
    log-probs in chunks of 4 tokens: the same loss and gradient norm."""
    results = []
    for index, options in enumerate([{}, dict(activation_checkpointing="full", offload="all",
                                              logprob_chunk_tokens=4)]):
        engine = _engine(model_dir, tmp_path / f"init{index}", **options)
        try:
            results.append([engine.train_step(batch, LOSS) for _ in range(2)][-1])
        finally:
            engine.close()
    plain, composed = results
    assert composed["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert composed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)

"""The FSDP training engine at world size 1 on the device: log-probs that agree with the
sampler's for the same tokens, a step that moves the weights, and offload / onload."""

import pytest
import torch
from device_helpers import LOSS, collect, logprob_tolerance, make_trainer, requests, \
    trained_weights
from fsdp_helpers import make_batch
from transformers import AutoTokenizer

from eddyrl.core.batching import build_train_batch
from eddyrl.protocol import Group, Trajectory
from eddyrl.engines.inference.hf import HFInferenceEngine

pytestmark = pytest.mark.hardware


@pytest.fixture
def trainer_factory(accelerator, tiny_model_dir, tmp_path):
    opened = []

    def build(**overrides):
        engine = make_trainer(tiny_model_dir, accelerator, str(tmp_path / f"pg{len(opened)}"),
                              **overrides)
        opened.append(engine)
        return engine

    yield build
    for engine in opened:
        engine.close()


def _local_device_types(engine) -> set[str]:
    return {(p.to_local() if hasattr(p, "to_local") else p).device.type
            for p in engine.model.parameters()}


def test_trainer_logprobs_agree_with_the_sampler(accelerator, tiny_model_dir, trainer_factory,
                                                 hardware_report):
    temperature = 0.7
    sampler = HFInferenceEngine(tiny_model_dir, accelerator, seed=5)
    # One generate call over prompts of different lengths: the sampler left-pads them and drops
    # finished rows from its KV cache; the trainer sees them right-padded in one batch.
    results = collect(sampler, requests("s", max_new=20, temperature=temperature)
                      + requests("t", max_new=9, temperature=temperature))
    pad_id = AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id
    groups = []
    for i in range(len(results) // 2):
        pair = [r for r in results if r.request_id in (f"s{i}", f"t{i}")]
        group = Group(f"g{i}", "", "", list(pair[0].prompt_ids), 0)
        group.trajectories += [Trajectory(r, float(k)) for k, r in enumerate(pair)]
        groups.append(group)
    batch = build_train_batch(groups, pad_id)

    trainer = trainer_factory(micro_batch_size=4, temperature=temperature)
    assert _local_device_types(trainer) == {accelerator.device_type}
    trained = trainer.compute_logprobs(batch)
    mask = batch.loss_mask.bool()
    diff = (trained.cpu() - batch.old_logprobs)[mask].abs()
    precision, tolerance = logprob_tolerance()
    hardware_report(tokens=int(mask.sum()), max_abs_diff=diff.max().item(),
                    mean_abs_diff=diff.mean().item(), fp32_matmul_precision=precision,
                    tolerance=tolerance)
    assert mask.sum() > 50 and torch.isfinite(trained).all()
    assert diff.max().item() < tolerance, f"max |sampler - trainer| = {diff.max().item():.2e}"


def test_train_step_moves_the_weights_on_the_device(accelerator, tiny_model_dir,
                                                    trainer_factory):
    batch = make_batch(tiny_model_dir)
    engine = trainer_factory()
    before = trained_weights(engine)
    metrics = engine.train_step(batch, LOSS)
    after = trained_weights(engine)
    assert engine.version == 1 and metrics["tokens"] == batch.num_tokens()
    for key in ("loss", "grad_norm", "clip_fraction", "approx_kl", "kl_ref"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["grad_norm"] > 0
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "model.embed_tokens.weight" in changed and len(changed) > len(before) // 2
    assert all(torch.isfinite(t).all() for t in after.values())


def test_offload_and_onload_keep_weights_optimizer_and_results(accelerator, tiny_model_dir,
                                                               trainer_factory, hardware_report):
    batch = make_batch(tiny_model_dir)
    engine = trainer_factory()
    engine.train_step(batch, LOSS)  # Adam state exists and must travel too
    logprobs = engine.compute_logprobs(batch)
    weights = sum(v.numel() * v.element_size() for v in trained_weights(engine).values())
    accelerator.synchronize()
    on_device = accelerator.memory_info().allocated
    engine.offload()
    off_device = accelerator.memory_info().allocated
    hardware_report(on_device_bytes=on_device, offloaded_bytes=off_device)
    if accelerator.device_type != "cpu":  # weights + two Adam moments left the device
        assert off_device <= on_device - weights
    engine.onload()
    assert _local_device_types(engine) == {accelerator.device_type}
    torch.testing.assert_close(engine.compute_logprobs(batch), logprobs, rtol=0, atol=0)
    metrics = engine.train_step(batch, LOSS)
    assert engine.version == 2 and torch.isfinite(torch.tensor(metrics["loss"]))

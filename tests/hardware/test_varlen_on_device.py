"""Packed training through the platform's variable-length attention, on each accelerator that
has one (`Platform.varlen_attention`: flash-attn's varlen path on CUDA, npu_fusion_attention
with actual sequence lengths on Ascend); skips, naming why, where there is none.

The platform check (eddyrl/platform_checks/varlen.py) on the device, then the FSDP engine with
`attention=varlen` in bf16: its log-probs against the same engine with the dense mask, and a
step that moves the weights."""

import pytest
import torch
from device_helpers import LOSS, make_trainer, trained_weights
from fsdp_helpers import make_batch

from eddyrl.platform_checks import CHECKS

pytestmark = pytest.mark.hardware

# |varlen - mask| log-prob gap accepted between two bf16 engines on the tiny model: both round
# to bf16 (~0.06 from fp32 measured on the CPU, eddy platforms check varlen_attention), in
# different kernels; a row that sees its neighbours moves log-probs by 0.3 or more.
BF16_GAP = 0.15


@pytest.fixture
def varlen(accelerator):
    implementation = accelerator.varlen_attention(torch.bfloat16)
    if implementation is None or not accelerator.supports_dtype(torch.bfloat16):
        pytest.skip(f"{accelerator.name}: no variable-length attention in bf16 here")
    return implementation


def test_the_varlen_check_passes_on_the_device(accelerator, varlen, hardware_report):
    detail = CHECKS["varlen_attention"](accelerator)
    hardware_report(attention=varlen, detail=detail)
    assert detail.startswith(f"{varlen} in bfloat16"), detail


def test_fsdp_in_varlen_matches_the_mask_and_trains(accelerator, varlen, tiny_model_dir,
                                                    tmp_path, hardware_report):
    batch = make_batch(tiny_model_dir)
    opened = []

    def build(attention):
        engine = make_trainer(tiny_model_dir, accelerator, str(tmp_path / attention),
                              param_dtype="bf16", attention=attention)
        opened.append(engine)
        return engine

    try:
        packed, masked = build("varlen"), build("mask")
        assert packed.varlen and not masked.varlen
        assert packed.model.config._attn_implementation == varlen
        gap = (packed.compute_logprobs(batch) - masked.compute_logprobs(batch)
               )[batch.attention_mask.bool()].abs().max().item()
        before = trained_weights(packed)
        metrics = packed.train_step(batch, LOSS)
        after = trained_weights(packed)
    finally:
        for engine in opened:
            engine.close()
    hardware_report(attention=varlen, max_abs_gap_to_mask=gap, loss=metrics["loss"])
    assert gap < BF16_GAP, f"max |varlen - mask| log-prob = {gap:.3g}"
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2

"""The rollout side of the cost model: a vLLM engine step (kernels plus the per-step costs a
roofline lacks) by hand, its fit to the published H100 decode points (datasheet 3a [C1]) and
what a roofline alone misses there, scaling by tp and by device, and chunked prefill through a
token budget by hand."""

import math
from dataclasses import replace

import pytest

from eddyrl.errors import ConfigError
from eddyrl.scheduler.cost_model import (NO_STEP_OVERHEADS, VLLM_STEP_OVERHEADS, CostModel,
                                         Efficiency, StepOverheads, fit_efficiency)
from eddyrl.scheduler.hardware import lookup_accelerator, lookup_model
from eddyrl.scheduler.rollout_cost import (VLLM_H100_DECODE_POINTS, WeightUpdate, c1_points,
                                           fit_step_overheads, staged_load_seconds)

OVERHEADS = StepOverheads(step_s=3e-3, per_sequence_s=20e-6, all_reduce_s=10e-6)


def test_a_decode_step_by_hand():
    """Qwen3-8B on one H100, 64 sequences of 1,000 tokens: fixed cost, per-sequence cost, the
    weights and the KV cache read at HBM rate, the matmuls at prefill_mfu."""
    cost = CostModel("H100", "Qwen3-8B", overheads=OVERHEADS)
    model, h100, eff = cost.model, cost.accelerator, cost.efficiency
    bandwidth = h100.hbm_bandwidth * eff.decode_bandwidth_efficiency
    kv_per_token = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads of 128, bf16
    by_hand = (3e-3 + 64 * 20e-6
               + model.matmul_params * 2 / bandwidth
               + 64 * 1000 * kv_per_token / bandwidth
               + 64 * 2 * model.matmul_params / (989e12 * eff.prefill_mfu))
    assert cost.decode_step_seconds(64, 1000) == pytest.approx(by_hand, rel=1e-12)


def test_tensor_parallelism_splits_the_bytes_and_pays_two_all_reduces_a_layer():
    """TP2: weights and matmuls halve, the KV cache splits over the ranks, and each of the
    2 x 64 layers' all-reduces pays its latency plus a ring of 2·(tp-1)/tp of its bytes."""
    one, two = (CostModel("H100", "Qwen3-32B", tp=tp, overheads=OVERHEADS) for tp in (1, 2))
    batch, context = 128, 2000
    fixed = 3e-3 + batch * 20e-6
    ring = 2 * 1 / 2 * batch * 5120 * 2 / (900e9 * one.efficiency.comm_efficiency)
    all_reduces = 2 * 64 * (10e-6 + ring)
    assert two.tp_all_reduce_seconds(batch) == pytest.approx(all_reduces, rel=1e-12)
    assert two.decode_step_seconds(batch, context) - fixed - all_reduces == pytest.approx(
        (one.decode_step_seconds(batch, context) - fixed) / 2, rel=1e-12)
    assert one.tp_all_reduce_seconds(batch) == 0


def test_a_faster_memory_shortens_the_bytes_not_the_overheads():
    """Device scaling: H200 streams the same bytes at 4.8 instead of 3.35 TB/s; host costs and
    matmuls (same peak) are unchanged."""
    h100, h200 = (CostModel(name, "Qwen3-14B") for name in ("H100", "H200"))
    zero = {"overheads": NO_STEP_OVERHEADS}
    memory = CostModel("H100", "Qwen3-14B", **zero).decode_memory_seconds(64, 3000)
    saved = memory * (1 - 3.35 / 4.8)
    assert h100.decode_step_seconds(64, 3000) - h200.decode_step_seconds(64, 3000) == \
        pytest.approx(saved, rel=1e-9)


def test_the_step_overheads_fit_the_published_vllm_points():
    """43 configurations, batch 8-474, TP1 and TP2, chat and reasoning lengths: the fit gives
    the cost model's defaults back, within 4 % rms and 12 % at worst."""
    fit = fit_step_overheads(VLLM_H100_DECODE_POINTS)
    print(fit.report())
    assert len(fit.points) == 43 and {p.tp for p in fit.points} == {1, 2}
    assert fit.rms < 0.04 and max(map(abs, fit.residuals)) < 0.12
    assert fit.efficiency.decode_bandwidth_efficiency == Efficiency().decode_bandwidth_efficiency
    for name in ("step_s", "per_sequence_s", "all_reduce_s"):
        assert getattr(fit.overheads, name) == pytest.approx(
            getattr(VLLM_STEP_OVERHEADS, name), rel=0.02), name
    assert "Qwen3-32B TP2" in fit.report() and "rms" in fit.report()


def test_a_roofline_alone_cannot_follow_the_points():
    """What the overheads are for: the best single HBM efficiency of a bare roofline leaves
    residuals of tens of percent (batch 8 wants ~0.6, batch 256 ~0.35)."""
    bare = [replace(point, overheads=NO_STEP_OVERHEADS) for point in VLLM_H100_DECODE_POINTS]
    fit = fit_efficiency(bare, "decode_bandwidth_efficiency")
    assert max(map(abs, fit.residuals)) > 0.3
    assert max(fit.implied) - min(fit.implied) > 0.3


def test_the_fit_recovers_overheads_that_made_the_points():
    truth = StepOverheads(step_s=2e-3, per_sequence_s=30e-6, all_reduce_s=15e-6)
    efficiency = Efficiency(decode_bandwidth_efficiency=0.8)
    made = [replace(point, seconds=point.predict(efficiency, truth))
            for point in VLLM_H100_DECODE_POINTS]
    fit = fit_step_overheads(made)
    assert fit.efficiency.decode_bandwidth_efficiency == pytest.approx(0.8)
    assert fit.rms < 1e-9
    assert fit.overheads.per_sequence_s == pytest.approx(30e-6, rel=1e-6)


def test_the_fit_takes_decode_points_only():
    from eddyrl.scheduler.cost_model import Measurement

    prefill = Measurement(accelerator="H100", model="Qwen3-8B", quantity="prefill_seconds",
                          arguments={"tokens": 100}, seconds=0.01)
    with pytest.raises(ConfigError, match="decode_step_seconds"):
        fit_step_overheads([prefill])
    assert c1_points(100)[0].arguments["mean_context"] == 100 + 610


def test_chunked_prefill_by_hand():
    """Three sequences of 5,000, 5,000 and 2,000 tokens through a budget of 8,192: two steps
    (8,192 and 3,808 tokens), each paying the fixed cost and reading the weights once; the
    matmuls of 12,000 tokens; each sequence's causal attention over itself; one per-sequence
    cost per sequence a step holds (3 sequences + 1 split)."""
    cost = CostModel("H100", "Qwen3-8B", overheads=OVERHEADS)
    model, eff = cost.model, cost.efficiency
    compute = 989e12 * eff.prefill_mfu
    weights = model.matmul_params * 2 / (3.35e12 * eff.decode_bandwidth_efficiency)
    attention = model.attention_flops_per_context_token * (
        2 * 5000 * 5001 / 2 + 2000 * 2001 / 2) / compute
    by_hand = (2 * (3e-3 + weights) + 12000 * 2 * model.matmul_params / compute + attention
               + 4 * 20e-6)
    steps, seconds = cost.chunked_prefill_seconds([5000, 5000, 2000], 8192)
    assert steps == 2 == math.ceil(12000 / 8192)
    assert seconds == pytest.approx(by_hand, rel=1e-12)
    assert cost.chunked_prefill_seconds([], 8192) == (0, 0.0)
    # a smaller budget: more steps, each paying the fixed costs and the weights again
    assert cost.chunked_prefill_seconds([5000, 5000, 2000], 512)[1] > seconds


def test_a_staged_load_is_a_copy_from_host_or_within_the_device():
    cost = CostModel("H800", "Qwen2.5-32B", tp=4)
    shard = cost.weights_bytes / 4
    assert staged_load_seconds(cost, True, 25e9) == pytest.approx(shard / 25e9)
    assert staged_load_seconds(cost, False, 25e9) == pytest.approx(
        2 * shard / (lookup_accelerator("H800").hbm_bandwidth
                     * cost.efficiency.decode_bandwidth_efficiency))
    update = WeightUpdate(load_s=0.4, kv_reset_s=0.1)
    assert update.pause_s == pytest.approx(0.5) and update.token_budget == 8192
    assert lookup_model("Qwen2.5-32B").layers == 64

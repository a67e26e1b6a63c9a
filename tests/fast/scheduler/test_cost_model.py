"""The cost model: datasheet tables, the decode roofline (memory-bound at batch 1,
compute-bound past the ridge point), calibration against HARDWARE.md's measured points,
monotonicity, and errors that name the bad value. (Parameter counts against transformers:
test_cost_model_parameter_counts.py.)"""

from dataclasses import replace

import pytest
from small_configs import small_config

from eddyrl.errors import ConfigError
from eddyrl.scheduler.cost_model import (H100_DECODE_POINTS, MOE_TRAIN_MFU, NO_STEP_OVERHEADS,
                                         CostModel, Efficiency, Measurement, fit_efficiency)
from eddyrl.scheduler.hardware import (ACCELERATORS, MODELS, lookup_accelerator, lookup_model,
                                       measure_cpu, model_from_hf_config)

KIB = 1024


# -- tables ------------------------------------------------------------------------------------

def test_accelerator_table_holds_the_datasheet_values():
    h100 = ACCELERATORS["H100"]
    assert (h100.peak_flops, h100.hbm_bytes, h100.hbm_bandwidth) == (989e12, 80e9, 3.35e12)
    assert (h100.intra_node_bandwidth, h100.inter_node_bandwidth) == (900e9, 50e9)
    assert ACCELERATORS["H200"].hbm_bytes == 141e9 and ACCELERATORS["H200"].hbm_bandwidth == 4.8e12
    assert ACCELERATORS["H800"].intra_node_bandwidth == 400e9
    assert ACCELERATORS["A800"].peak_flops == 312e12
    assert ACCELERATORS["A800"].inter_node_bandwidth == 25e9  # 200 Gb/s IB
    assert ACCELERATORS["910B2"].peak_flops == pytest.approx(353.9e12)
    assert ACCELERATORS["910B2"].intra_node_bandwidth == 196e9
    assert ACCELERATORS["910B3"].peak_flops == pytest.approx(294.9e12)
    assert ACCELERATORS["H20"].peak_flops == 148e12 and ACCELERATORS["H20"].hbm_bytes == 96e9
    assert lookup_accelerator("910B") is ACCELERATORS["910B2"]
    assert all(accelerator.source for accelerator in ACCELERATORS.values())


@pytest.mark.parametrize("name, ridge", [("H100", 295), ("H200", 206), ("A800", 153),
                                         ("910B2", 221), ("H20", 37)])
def test_ridge_points_match_the_datasheet(name, ridge):
    assert ACCELERATORS[name].ridge_point == pytest.approx(ridge, rel=0.01)


# name: total, non-embedding, active (billions), KV/token (KiB): HARDWARE.md section 2.
DATASHEET_MODELS = {
    "Qwen2.5-7B": (7.62, 6.53, 7.62, 56),
    "Qwen2.5-32B": (32.76, 31.2, 32.76, 256),
    "Qwen3-1.7B": (1.72, 1.41, 1.72, 112),
    "Qwen3-4B": (4.02, 3.63, 4.02, 144),
    "Qwen3-8B": (8.19, 6.95, 8.19, 144),  # not in the sheet: its public model card
    "Qwen3-14B": (14.77, 13.21, 14.77, 160),
    "Qwen3-32B": (32.76, 31.21, 32.76, 256),
    "Qwen3-30B-A3B": (30.53, 29.9, 3.35, 96),
}


@pytest.mark.parametrize("name", DATASHEET_MODELS)
def test_model_table_matches_the_datasheet_counts(name):
    total, non_embedding, active, kv_kib = DATASHEET_MODELS[name]
    model = MODELS[name]
    assert model.total_params / 1e9 == pytest.approx(total, abs=0.01)
    assert model.non_embedding_params / 1e9 == pytest.approx(non_embedding, abs=0.01)
    assert model.active_params / 1e9 == pytest.approx(active, abs=0.01)
    assert model.kv_bytes_per_token() == kv_kib * KIB


def test_kv_bytes_per_token():
    assert lookup_model("Qwen2.5-7B").kv_bytes_per_token() == 56 * KIB
    assert lookup_model("Qwen3-32B").kv_bytes_per_token() == 256 * KIB
    assert lookup_model("Qwen3-32B").kv_bytes_per_token(dtype_bytes=1) == 128 * KIB


def test_forward_flops_match_the_datasheet():
    # "Forward linear FLOPs per token" and "attention FLOPs per context token", section 2 notes.
    for name, linear, attention in (("Qwen2.5-7B", 14.1e9, 0.40e6), ("Qwen3-32B", 64.0e9, 2.10e6),
                                    ("Qwen2.5-32B", 64.0e9, 1.31e6)):
        assert 2 * MODELS[name].matmul_params == pytest.approx(linear, rel=0.005)
        assert MODELS[name].attention_flops_per_context_token == pytest.approx(attention, rel=0.01)
    assert 2 * MODELS["Qwen3-30B-A3B"].matmul_params == pytest.approx(6.1e9, rel=0.01)


def test_a_config_missing_a_key_is_named():
    config = small_config("qwen3")
    del config["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size'"):
        model_from_hf_config("broken", config)


# -- decode roofline ---------------------------------------------------------------------------

def _first_compute_bound_batch(cost_model, mean_context=0):
    return next(batch for batch in range(1, 10_000)
                if cost_model.decode_compute_seconds(batch, mean_context)
                >= cost_model.decode_memory_seconds(batch, mean_context))


@pytest.mark.parametrize("accelerator", ["H100", "A800", "910B2"])
def test_decode_turns_compute_bound_at_the_ridge_point(accelerator):
    """At full efficiency and no KV cache a bf16 dense step does one multiply-add per weight byte
    per sequence, so memory and compute meet at batch = ridge point."""
    ideal = Efficiency(prefill_mfu=1.0, decode_bandwidth_efficiency=1.0)
    cost_model = CostModel(accelerator, "Qwen3-8B", ideal)
    crossover = _first_compute_bound_batch(cost_model)
    assert abs(crossover - ACCELERATORS[accelerator].ridge_point) <= 1
    default = CostModel(accelerator, "Qwen3-8B")
    assert default.decode_memory_seconds(1, 0) > 10 * default.decode_compute_seconds(1, 0)
    assert 0.5 < _first_compute_bound_batch(default) / cost_model.accelerator.ridge_point < 2


def test_a_long_context_keeps_decode_memory_bound():
    cost_model = CostModel("H100", "Qwen3-8B")
    for batch in (1, 64, 512, 4096):
        assert cost_model.decode_memory_seconds(batch, 4000) > cost_model.decode_compute_seconds(
            batch, 4000)


def test_moe_decode_reads_more_experts_as_the_batch_grows():
    moe = MODELS["Qwen3-30B-A3B"]
    assert moe.params_read(1) == pytest.approx(moe.matmul_params)
    reads = [moe.params_read(batch) for batch in (1, 8, 64, 1024)]
    assert reads == sorted(reads)
    everything_but_the_input_embedding = moe.total_params - moe.vocab * moe.hidden
    assert reads[-1] == pytest.approx(everything_but_the_input_embedding, rel=1e-6)


# -- calibration -------------------------------------------------------------------------------

def test_decode_efficiency_fitted_on_the_h100_points():
    """HARDWARE.md 3a: H100, vLLM, TP1, batch 8: Qwen3-8B 962, 14B 627, 32B 312 tok/s. With
    vLLM's step overheads counted apart (fitted on all 43 points, rollout_cost.py), the batch-8
    points alone imply the default HBM efficiency within 0.05."""
    fit = fit_efficiency(H100_DECODE_POINTS, "decode_bandwidth_efficiency")
    print(fit.report())
    assert all(abs(residual) < 0.05 for residual in fit.residuals)
    default = Efficiency().decode_bandwidth_efficiency
    assert fit.efficiency.decode_bandwidth_efficiency == pytest.approx(default, abs=0.05)
    assert all(name in fit.report() for name in ("Qwen3-8B", "Qwen3-14B", "Qwen3-32B"))


def test_decode_efficiency_on_the_a100_batch_1_points():
    """HARDWARE.md 3a: A100, vLLM, batch 1: Qwen2.5-7B 84.3, 32B 22.1 tok/s (2048 generated).
    The sheet's column (63 % / 71 %) is a bare roofline; with vLLM's step overheads (fitted on
    H100 points, another device and vLLM version) the same points imply 76-81 %."""
    def fit(overheads):
        return fit_efficiency([
            Measurement.decode("A100", model, batch=1, mean_context=1024, tokens_per_second=rate,
                               overheads=overheads)
            for model, rate in (("Qwen2.5-7B", 84.3), ("Qwen2.5-32B", 22.1))],
            "decode_bandwidth_efficiency")
    print(fit(NO_STEP_OVERHEADS).report())
    # a bare roofline (the batch-1 matmuls added): it counts the input embedding as read
    assert list(fit(NO_STEP_OVERHEADS).implied) == pytest.approx([0.63, 0.71], abs=0.05)
    assert list(fit(None).implied) == pytest.approx([0.81, 0.76], abs=0.03)


@pytest.mark.parametrize("factor, quantity, arguments", [
    ("prefill_mfu", "prefill_seconds", {"tokens": 4096, "context": 1000}),
    ("train_mfu", "train_step_seconds", {"tokens": 10**6, "dp": 4, "sequence_length": 4096}),
    ("comm_efficiency", "kv_transfer_seconds", {"tokens": 8000, "bandwidth": 50e9}),
])
def test_fit_recovers_the_factor_that_made_the_points(factor, quantity, arguments):
    truth = replace(Efficiency(), **{factor: 0.37})
    points = [Measurement(accelerator=accelerator, model="Qwen3-14B", quantity=quantity,
                          arguments=arguments, tp=tp,
                          seconds=getattr(CostModel(accelerator, "Qwen3-14B", truth, tp=tp),
                                          quantity)(**arguments))
              for accelerator in ("H100", "910B2") for tp in (1, 2)]
    fit = fit_efficiency(points, factor)
    assert getattr(fit.efficiency, factor) == pytest.approx(0.37, rel=1e-6)
    assert max(map(abs, fit.residuals)) < 1e-6


def test_fit_refuses_points_that_do_not_depend_on_the_factor():
    with pytest.raises(ConfigError, match="does not depend on 'train_mfu'"):
        fit_efficiency(H100_DECODE_POINTS, "train_mfu")
    with pytest.raises(ConfigError, match="'decode_mfu'.*'prefill_mfu'"):
        fit_efficiency(H100_DECODE_POINTS, "decode_mfu")


# -- shape of the estimates --------------------------------------------------------------------

def test_more_tokens_take_more_time():
    cost_model = CostModel("H100", "Qwen3-14B")
    for estimate in (cost_model.prefill_seconds, cost_model.train_step_seconds,
                     cost_model.reprefill_seconds):
        times = [estimate(tokens) for tokens in (1, 100, 10_000, 1_000_000)]
        assert times == sorted(times) and times[0] < times[-1]
    assert cost_model.prefill_seconds(1000, context=5000) > cost_model.prefill_seconds(1000)
    steps = [cost_model.decode_step_seconds(batch, 1000) for batch in (1, 8, 64, 512)]
    assert steps == sorted(steps)


def test_more_tensor_parallelism_takes_less_time():
    by_tp = {tp: CostModel("H100", "Qwen3-32B", tp=tp) for tp in (1, 2, 4, 8)}
    for estimate in ("prefill_seconds", "train_step_seconds"):
        times = [getattr(cost_model, estimate)(100_000) for cost_model in by_tp.values()]
        assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
    decode = [cost_model.decode_step_seconds(64, 2000) for cost_model in by_tp.values()]
    assert decode == sorted(decode, reverse=True) and len(set(decode)) == len(decode)


def test_the_fsdp_collectives_slow_down_across_many_nodes():
    cost_model = CostModel("H100", "Qwen3-8B")
    alone, in_node, across_nodes = (cost_model.train_step_seconds(0, dp=dp)
                                    for dp in (1, 8, 128))
    assert alone < in_node  # one device: the optimizer step alone, no collective
    # each accelerator's own NIC carries 1/8 of what crosses (train_cost.collective_seconds):
    # slower than NVLink, not by the links' 18x
    assert 1.2 * in_node < across_nodes < 3 * in_node
    assert cost_model.train_step_seconds(10**7, dp=8) < cost_model.train_step_seconds(10**7)


def test_moe_trains_at_the_lower_default_mfu():
    assert CostModel("H100", "Qwen3-30B-A3B").efficiency.train_mfu == MOE_TRAIN_MFU
    assert CostModel("H100", "Qwen3-32B").efficiency.train_mfu == Efficiency().train_mfu


def test_a_fast_link_carries_the_kv_cache_and_a_slow_one_recomputes_it():
    cost_model = CostModel("H100", "Qwen3-8B")
    nvlink, ten_gbe = 900e9, 1.25e9
    assert cost_model.kv_transfer_beats_reprefill(4000, nvlink)
    assert not cost_model.kv_transfer_beats_reprefill(4000, ten_gbe)
    ratios = [cost_model.kv_transfer_seconds(tokens, ten_gbe) / cost_model.reprefill_seconds(tokens)
              for tokens in (100, 10_000, 100_000)]
    assert ratios == sorted(ratios, reverse=True)  # re-prefill is quadratic, transfer linear


def test_weight_sync_is_bytes_over_the_usable_link():
    cost_model = CostModel("H20", "Qwen2.5-7B", Efficiency(comm_efficiency=0.5))
    assert cost_model.weight_sync_seconds(cost_model.weights_bytes, 50e9) == pytest.approx(
        cost_model.model.total_params * 2 / 25e9)


# -- bad inputs --------------------------------------------------------------------------------

def test_bad_inputs_name_the_value():
    cost_model = CostModel("H100", "Qwen3-8B")
    with pytest.raises(ConfigError, match="'tokens' = -1"):
        cost_model.prefill_seconds(-1)
    with pytest.raises(ConfigError, match="'batch' = 0"):
        cost_model.decode_step_seconds(0, 100)
    with pytest.raises(ConfigError, match="'tp' = 0"):
        CostModel("H100", "Qwen3-8B", tp=0)
    with pytest.raises(ConfigError, match="'train_mfu' = 1.5"):
        Efficiency(train_mfu=1.5)
    with pytest.raises(ConfigError, match="'H1000'.*'H100'.*'910B2'.*did you mean 'H100'"):
        CostModel("H1000", "Qwen3-8B")
    with pytest.raises(ConfigError, match="'Qwen3-7B'.*'Qwen3-8B'"):
        lookup_model("Qwen3-7B")
    with pytest.raises(ConfigError, match="'quantity' = 'decode'"):
        Measurement(accelerator="H100", model="Qwen3-8B", quantity="decode", arguments={},
                    seconds=1.0)


# -- the measured CPU --------------------------------------------------------------------------

def test_measure_cpu_is_positive():
    cpu = measure_cpu()  # its time budget is its own (a loaded machine overruns it)
    assert cpu.name == "cpu-measured"
    assert cpu.peak_flops > 1e8 and cpu.hbm_bandwidth > 1e8 and cpu.hbm_bytes > 1e8
    estimate = CostModel(cpu, "Qwen3-1.7B", dtype_bytes=4).decode_step_seconds(1, 100)
    assert 0 < estimate < 3600

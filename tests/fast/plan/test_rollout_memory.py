"""The rollout engine's memory as the plan models it (plan/rollout_memory.py) and the settings
behind it: `rollout.dtype`, the run's longest sequence as the engine's context, and the KV cache
sized exactly (max_batch_size sequences) or pooled from a share of the device
(`rollout.memory_fraction`); a share too small to start is refused, and the fixes take bf16
before fewer sequences. Pure arithmetic and config: no model, no device."""

import json

import pytest
import torch

from eddyrl.cli import main
from eddyrl.config import load_config
from eddyrl.engines.inference.base import engine_dtype
from eddyrl.errors import ConfigError
from eddyrl.models.config import SHAPES
from eddyrl.plan.rollout_memory import (KV_BLOCK_TOKENS, RolloutOptions, kv_bytes_per_token,
                                        rollout_memory)
from eddyrl.plan.shapes import load_shape

RECIPE = "recipes/qwen3_4b_dapo_math_gpu"  # bf16, memory_fraction 0.9, max_batch_size 256
SHAPE = load_shape(SHAPES / "Qwen3-4B")
DEVICE = 80 * 10**9
LONGEST = 22528  # 2,048 + 20,480: whole KV blocks


def options(**changes) -> RolloutOptions:
    base = dict(engine="vllm", max_batch_size=256, longest=LONGEST, prompt_tokens=2048,
                max_model_len=LONGEST, dtype="bf16", memory_fraction=0.9, device_bytes=DEVICE)
    return RolloutOptions(**{**base, **changes})


def plan(capsys, *overrides) -> tuple[int, dict]:
    status = main(["plan", RECIPE, "--device", "H100", "--json", *overrides])
    return status, json.loads(capsys.readouterr().out)


def rollout_device(result: dict) -> dict:
    (device,) = [d for d in result["devices"] if d["label"] == "rollout"]
    return device


def test_a_share_of_the_device_is_the_peak_and_what_it_leaves_is_the_kv_pool():
    memory = rollout_memory(SHAPE, options())
    share = int(0.9 * DEVICE)
    assert memory.peak == share and memory.short == 0
    assert memory.weights == SHAPE.parameters() * 2  # bf16
    pool = (share - memory.weights - memory.workspace) // kv_bytes_per_token(SHAPE, 2)
    assert memory.kv_tokens == pool // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
    assert memory.concurrent_sequences == memory.kv_tokens // LONGEST


def test_the_pool_is_not_reserved_per_sequence_of_the_batch_cap():
    capped, wide = (rollout_memory(SHAPE, options(max_batch_size=n)) for n in (16, 256))
    assert capped.peak == wide.peak
    assert capped.kv_tokens >= wide.kv_tokens  # only the sampler's workspace grows
    exact = rollout_memory(SHAPE, options(memory_fraction=0.0, max_batch_size=16))
    assert exact.kv_tokens == 16 * LONGEST and exact.concurrent_sequences == 16


def test_bf16_halves_the_weights_and_the_exact_kv_cache():
    fp32, bf16 = (rollout_memory(SHAPE, options(memory_fraction=0.0, max_batch_size=8,
                                                dtype=dtype)) for dtype in ("fp32", "bf16"))
    assert fp32.weights == 2 * bf16.weights and fp32.kv_cache == 2 * bf16.kv_cache
    assert fp32.kv_tokens == bf16.kv_tokens == 8 * LONGEST


def test_the_context_is_the_runs_longest_sequence_within_the_models_positions(capsys):
    _, result = plan(capsys, "rollout.memory_fraction=0", "rollout.max_batch_size=2")
    details = rollout_device(result)["roles"][0]["details"]
    assert details["max_model_len"] == LONGEST and details["kv_tokens"] == 2 * LONGEST
    _, result = plan(capsys, "rollout.max_new_tokens=40000")  # over Qwen3's 40,960
    assert rollout_device(result)["roles"][0]["details"]["max_model_len"] == 40960


def test_a_share_too_small_for_one_sequence_is_refused_and_raised(capsys):
    status, result = plan(capsys, "rollout.memory_fraction=0.1")  # under the weights
    device = rollout_device(result)
    assert status == 1 and not device["fits"] and device["margin"] > device["reserve"]
    assert "refuses to start" in device["roles"][0]["refused"]
    assert [f["override"] for f in result["fixes"]] == ["rollout.memory_fraction=0.95"]
    status, result = plan(capsys, "rollout.memory_fraction=0.99")  # over the kept-free share
    assert status == 1 and not rollout_device(result)["roles"][0]["refused"]
    assert [f["override"] for f in result["fixes"]] == ["rollout.memory_fraction=0.95"]
    assert plan(capsys, "rollout.memory_fraction=0.95")[0] == 0


def test_a_float32_engine_over_its_device_takes_bf16_before_fewer_sequences(capsys):
    status, result = plan(capsys, "rollout.dtype=fp32", "rollout.memory_fraction=0")
    fixes = [f["override"] for f in result["fixes"]]
    assert status == 1 and fixes[0] == "rollout.dtype=bf16"
    assert fixes[1].startswith("rollout.max_batch_size=") and result["fixes"][-1]["fits"]
    status, out = plan(capsys, "rollout.memory_fraction=0", *fixes)
    assert status == 0 and out["fits"]


def test_the_settings_are_checked_by_key():
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(overrides=["rollout.dtype=fp64"])
    with pytest.raises(ConfigError, match="rollout.memory_fraction"):
        load_config(overrides=["rollout.engine=vllm", "rollout.memory_fraction=1.5"])
    with pytest.raises(ConfigError, match="'rollout.memory_fraction' = 0.9 needs a paged"):
        load_config(overrides=["rollout.engine=hf", "rollout.memory_fraction=0.9"])


def test_the_engines_are_given_the_runs_dtype_and_longest_sequence():
    config = load_config(overrides=["rollout.dtype=bf16", "data.max_prompt_tokens=100",
                                    "rollout.max_new_tokens=50"])
    assert config.rollout_engine_options() == {"dtype": "bfloat16", "max_model_len": 150,
                                               "memory_fraction": 0.0}


class _NoHalf:
    name = "nohalf"

    @staticmethod
    def supports_dtype(dtype):
        return dtype == torch.float32


def test_a_dtype_the_platform_lacks_is_refused_by_key():
    assert engine_dtype(_NoHalf(), "float32") is torch.float32
    with pytest.raises(ConfigError, match="'rollout.dtype' = 'bfloat16' is not supported on "
                                          "platform 'nohalf'"):
        engine_dtype(_NoHalf(), "bfloat16")
    with pytest.raises(ConfigError, match="rollout.dtype"):
        engine_dtype(_NoHalf(), "float64")

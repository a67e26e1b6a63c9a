"""The memory plan of a model split over devices (plan/memory_plan.py `Parallelism`): a rollout
instance's tensor parallelism as vLLM partitions it, a trainer group's Ulysses sequence
parallelism under an FSDP group of its own size. Each device's bytes against the whole model's,
by arithmetic on a shipped shape."""

from __future__ import annotations

import pytest

from eddyrl.models.config import SHAPES
from eddyrl.plan.rollout_memory import (RolloutOptions, kv_bytes_per_token, rollout_memory,
                                        weight_parameters_per_device)
from eddyrl.plan.shapes import load_shape
from eddyrl.plan.training_memory import TrainingOptions, memory_moments, training_memory

QWEN32 = load_shape(SHAPES / "Qwen2.5-32B")  # 40 heads, 8 KV heads
SMALL = load_shape(SHAPES / "DeepSeek-R1-Distill-Qwen-1.5B")  # 12 heads, 2 KV heads
GIB = 2**30


def _rollout(shape, tp, **changes):
    base = dict(engine="vllm", max_batch_size=256, longest=30300, prompt_tokens=300,
                max_model_len=30300, dtype="bf16", memory_fraction=0.9,
                device_bytes=80 * 10**9, tensor_parallel=tp)
    return rollout_memory(shape, RolloutOptions(**{**base, **changes}))


def test_one_device_is_the_whole_model():
    assert weight_parameters_per_device(QWEN32, 1) == QWEN32.parameters()
    assert kv_bytes_per_token(QWEN32, 2, 1) == 2 * 64 * 8 * 128 * 2


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_weights_and_kv_split_over_the_instance(tp):
    per_device = weight_parameters_per_device(QWEN32, tp)
    # the norms stay whole on each device: a little over an even share, never under it
    assert QWEN32.parameters() / tp <= per_device < QWEN32.parameters() / tp * 1.001
    assert kv_bytes_per_token(QWEN32, 2, tp) * tp == kv_bytes_per_token(QWEN32, 2, 1)
    one, wide = _rollout(QWEN32, 1), _rollout(QWEN32, tp)
    assert wide.weights == per_device * 2
    # each device's pool holds the same tokens; freed weights make it hold more of them
    assert wide.kv_tokens > one.kv_tokens * tp


def test_kv_heads_are_replicated_past_their_number():
    """2 KV heads on 4 devices: each device caches (and projects) one, as vLLM does."""
    assert kv_bytes_per_token(SMALL, 2, 4) == kv_bytes_per_token(SMALL, 2, 2)
    replicated = weight_parameters_per_device(SMALL, 4)
    even = SMALL.parameters() / 4
    kv_share = SMALL.layers * 2 * SMALL.head_dim * (SMALL.hidden + 1)  # one head's k and v
    assert replicated == pytest.approx(even + kv_share / 2, rel=0.01)


def test_a_tensor_parallel_degree_below_one_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel"):
        _rollout(QWEN32, 0)


def _options(sp, **changes):
    base = dict(tokens_per_micro_batch=121200, rows_per_micro_batch=4, world_size=16,
                param_dtype="bf16", activation_checkpointing="selective", attention="varlen",
                sequence_parallel=sp)
    return TrainingOptions(**{**base, **changes})


def test_sequence_parallel_splits_the_activations_not_the_state():
    one = memory_moments(QWEN32, _options(1))
    eight = memory_moments(QWEN32, _options(8))
    tokens_only = memory_moments(QWEN32, _options(1, tokens_per_micro_batch=121200 // 8))
    for moment in ("head forward", "head backward"):  # what a device's tokens hold
        assert eight[moment].activations * 8 == one[moment].activations
        assert eight[moment].logprob == tokens_only[moment].logprob
        # the sharded state is the FSDP group's, whatever the sequence split
        assert (eight[moment].optimizer, eight[moment].gradients) == (
            one[moment].optimizer, one[moment].gradients)
    # in a layer's backward, the all-to-alls' buffers come on top of an eighth's activations
    backward = "layer backward"
    a2a = 2 * (2 * QWEN32.q_width + 2 * QWEN32.kv_width) * 2 * (121200 // 8)
    assert eight[backward].activations == tokens_only[backward].activations + a2a
    assert training_memory(QWEN32, _options(8)).peak < training_memory(QWEN32, _options(1)).peak


def test_the_fsdp_group_shards_the_state():
    two = memory_moments(QWEN32, _options(8, world_size=2))["optimizer step"]
    sixteen = memory_moments(QWEN32, _options(8, world_size=16))["optimizer step"]
    assert two.gradients == pytest.approx(sixteen.gradients * 8, rel=1e-6)
    assert two.weights == pytest.approx(sixteen.weights * 8, rel=1e-6)


def test_a_sequence_parallel_degree_below_one_is_refused():
    with pytest.raises(ValueError, match="sequence_parallel"):
        _options(0)


def test_ranks_that_do_not_divide_into_sequence_parallel_groups_are_named():
    from eddyrl.config import load_config
    from eddyrl.errors import ConfigError
    from eddyrl.plan.memory_plan import Parallelism, training_options

    config = load_config(overrides=["train.num_workers=4"])
    assert training_options(config, "varlen", parallel=Parallelism(train_sp=2)) \
        .sequence_parallel == 2
    with pytest.raises(ConfigError, match="train.num_workers = 4 .* sequence-parallel degree 3"):
        training_options(config, "varlen", parallel=Parallelism(train_sp=3))

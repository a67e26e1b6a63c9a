"""eddyrl/plan/training_memory.py and activations.py: the arithmetic of the memory plan, on the
shapes alone. The per-layer activation formula against what autograd keeps in a real
transformers Qwen3 layer: test_saved_activations.py; bench/memory.py checks whole steps
against the measured peak."""

import pytest

from eddyrl.plan.activations import layer_bytes_per_token
from eddyrl.plan.shapes import ModelShape
from eddyrl.plan.training_memory import TrainingOptions, memory_moments, training_memory

SHAPE = ModelShape(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8,
                   head_dim=128, vocab=151936, tied_embeddings=True)  # Qwen3-0.6B
GIB = 1 << 30


def plan(shape=SHAPE, **options):
    options.setdefault("tokens_per_micro_batch", 8192)
    options.setdefault("attention", "flash")
    return training_memory(shape, TrainingOptions(**options))


def moments(shape=SHAPE, **options):
    """The plan's breakdown at every moment of the step."""
    options.setdefault("tokens_per_micro_batch", 8192)
    options.setdefault("attention", "flash")
    return memory_moments(shape, TrainingOptions(**options))


def test_checkpointing_keeps_each_layers_input_and_recomputes_one_layer():
    tokens = 8192
    per_layer = layer_bytes_per_token(SHAPE, 4, "flash", tokens)
    kept = {kind: moments(activation_checkpointing=kind)["head forward"].activations
            for kind in ("none", "full", "selective")}
    assert kept["none"] == SHAPE.layers * per_layer * tokens
    assert kept["full"] == SHAPE.layers * SHAPE.hidden * 4 * tokens
    # the predicted factor: a layer's saved tensors over its input
    assert kept["none"] / kept["full"] == per_layer / (SHAPE.hidden * 4)
    # selective keeps the attention kernel's output and log-sum-exp besides
    assert kept["selective"] - kept["full"] == SHAPE.layers * tokens * (2048 * 4 + 16 * 4)
    # in the backward, one layer at a time is recomputed in full
    recompute = moments(activation_checkpointing="full")["layer backward"].activations
    assert kept["full"] + per_layer * tokens < recompute < kept["none"]
    peaks = [plan(activation_checkpointing=kind).peak for kind in ("full", "selective", "none")]
    assert peaks == sorted(peaks)


def test_chunked_logprob_is_bounded_by_the_chunk_not_the_sequence():
    vocab_bytes = SHAPE.vocab * 4
    full_16k = plan(tokens_per_micro_batch=16384, activation_checkpointing="full")
    assert full_16k.logprob >= 2 * 16384 * vocab_bytes  # two [tokens, vocab] fp32 buffers
    chunked = [plan(tokens_per_micro_batch=t, activation_checkpointing="full",
                    logprob_chunk_tokens=1024) for t in (16384, 65536)]
    head = [m.logprob for m in chunked]
    # growing 4x in tokens adds only [tokens, hidden] terms, nothing of [tokens, vocab]
    assert head[1] - head[0] < 48 * SHAPE.hidden * 4 * (65536 - 16384) / 4
    assert head[0] < 3 * 1024 * vocab_bytes + 3 * SHAPE.vocab * SHAPE.hidden * 4
    assert chunked[0].peak < full_16k.peak


def test_the_head_holds_two_chunk_buffers_whatever_the_chunk_count():
    """logprob.py frees each chunk's buffers before the next chunk's exist: two [chunk, vocab]
    fp32 buffers at a time, so four chunks of n hold what one chunk of n holds."""
    def head_backward(tokens, chunk):
        return moments(tokens_per_micro_batch=tokens, logprob_chunk_tokens=chunk,
                       activation_checkpointing="full")["head backward"].logprob

    n, v, h = 16384, SHAPE.vocab, SHAPE.hidden
    one_chunk = head_backward(n, n)
    four_chunks = head_backward(4 * n, n)
    # only per-token terms of hidden width grow (saved hidden states, their gradient, rotary)
    assert 0 < four_chunks - one_chunk < 3 * n * h * 4 * 5
    assert one_chunk >= 8 * n * v + v * h * 4  # two buffers + the fp32 accumulator


def test_lora_trains_only_the_adapters():
    options = dict(lora_rank=16, lora_targets=("q_proj", "v_proj"))
    adapter = SHAPE.layers * 16 * ((1024 + 2048) + (1024 + 1024))
    step = moments(**options)["optimizer step"]
    assert step.weights == (SHAPE.parameters() + adapter) * 4  # the frozen base stays, fp32
    assert step.gradients == adapter * 4  # nothing of the base
    assert step.optimizer == 3 * adapter * 4  # + foreach AdamW's temporary per parameter
    per_tensor = moments(foreach_optimizer=False, **options)["optimizer step"]
    assert per_tensor.optimizer == 2 * adapter * 4 + 2 * 16 * 2048 * 4  # two of q's lora_B
    full = moments()["optimizer step"]
    assert full.gradients == SHAPE.parameters() * 4
    assert plan(**options).peak < plan().peak


def test_offload_moves_state_to_the_host():
    none, optimizer, everything = (plan(offload=kind) for kind in ("none", "optimizer", "all"))
    params = SHAPE.parameters()
    assert optimizer.host == 2 * params * 4 and everything.host == 4 * params * 4
    assert everything.peak < optimizer.peak < none.peak


def test_weights_gradients_and_moments_shard_over_ranks():
    one, eight = plan(), plan(world_size=8)
    assert one.moments["optimizer step"] > 7 * (eight.moments["optimizer step"]
                                                 - 3 * SHAPE.vocab * SHAPE.hidden * 4 / 8)
    assert eight.peak < one.peak


def test_mixed_precision_gathers_in_bf16_and_the_mask_grows_with_the_square():
    fp32, bf16 = plan(world_size=8), plan(world_size=8, param_dtype="bf16")
    assert bf16.weights < fp32.weights and bf16.activations < fp32.activations
    masked = plan(attention="mask", rows_per_micro_batch=2)
    assert masked.attention_mask == 2 * 4096 * 4096


@pytest.mark.parametrize("key,value", [("param_dtype", "fp8"), ("activation_checkpointing", "x"),
                                       ("offload", "gpu"), ("attention", "ring")])
def test_bad_options_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"{key} = '{value}'"):
        TrainingOptions(tokens_per_micro_batch=8, **{key: value})

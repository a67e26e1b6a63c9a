"""Shared-prompt packing (engines/training/packing.py) on the tiny model, pinned to the row
layout.

Over seeded random batches of prompt groups (packing_cases.py), micro-batches of random sizes
and pack bounds: the packed forward gives the row layout's log-probs and gradients up to float
summation order (both the `sdpa` boolean mask and the `eager` additive one), and the FSDP
engine's step with packing takes the plain full-batch step. (Which rows go into which pack:
test_packing.py.)
"""

import random

import pytest
import torch
from fsdp_helpers import assert_takes_the_plain_step, plain_logprobs, save_tiny_model
from packing_cases import LOSS, grouped_batch
from transformers import AutoModelForCausalLM

from eddyrl.engines.registry import load_engine_class
from eddyrl.engines.training.packing import micro_batches, micro_logprobs, place_rows
from eddyrl.hal import get_platform


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("seed", range(6))
def test_packed_log_probs_and_gradients_are_the_row_layouts(model_dir, attention, seed):
    rng = random.Random(100 + seed)
    batch = grouped_batch(seed)
    size, bound = rng.randrange(1, 12), rng.choice([4, 16, 8192])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attention)
    want = plain_logprobs(model, batch.input_ids, batch.attention_mask, 0.9)
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(seed))
    (want * weights * batch.attention_mask).sum().backward()
    want_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    got = torch.full(batch.input_ids.shape, float("nan"))
    parts = micro_batches(batch, size, share_prompts=True, max_packed_tokens=bound)
    assert sorted(i for m in parts for i in m.rows.tolist()) == list(range(len(batch)))
    for micro in parts:
        assert len(micro.rows) <= size
        logprobs = micro_logprobs(model, micro, 0.9, chunk_tokens=7).logprobs
        real = micro.batch.attention_mask.bool()
        (logprobs * weights[micro.rows, :logprobs.shape[1]] * real).sum().backward()
        place_rows(got, micro.rows, micro.batch, logprobs.detach())
    real = batch.attention_mask.bool()
    got = torch.where(real, got, 0.0)  # positions after a micro-batch's cut are never written
    assert (got - want.detach())[real].abs().max().item() < 1e-5
    grads = _grads(model)
    assert (grads - want_grads).norm() <= 1e-5 * want_grads.norm()


def test_fsdp_step_with_packing_takes_the_plain_full_batch_step(model_dir, tmp_path):
    batch = grouped_batch(7)
    engine = load_engine_class("train", "fsdp")(
        model_dir, get_platform("cpu"), 0, 1, f"file://{tmp_path}/pg", lr=1e-3,
        micro_batch_size=5, share_prompts=True)
    try:
        assert engine.share_prompts
        got_logprobs = torch.full(batch.input_ids.shape, float("nan"))
        metrics = engine.train_step(batch, LOSS, logprobs_out=got_logprobs)
    finally:
        engine.close()
    assert_takes_the_plain_step(model_dir, batch, LOSS, metrics, got_logprobs)

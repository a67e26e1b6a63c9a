"""Shared-prompt packing (engines/training/packing.py) pinned to the row layout.

Over seeded random batches of prompt groups (prompts of different lengths, 1 to 6 samples each,
responses of different lengths, some rows with no response), micro-batches of random sizes and
pack bounds: every row lands in exactly one micro-batch, a prompt's rows stay together unless
a bound splits them, and the packed forward gives the row layout's log-probs and gradients up
to float summation order (both the `sdpa` boolean mask and the `eager` additive one). The FSDP
engine's step with packing takes the plain full-batch step.
"""

import random

import pytest
import torch
from fsdp_helpers import assert_takes_the_plain_step, plain_logprobs, save_tiny_model
from transformers import AutoModelForCausalLM

from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.registry import load_engine_class
from eddyrl.engines.training.packing import micro_batches, micro_logprobs, place_rows
from eddyrl.hal import get_platform
from eddyrl.protocol import TrainBatch

LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def grouped_batch(seed: int) -> TrainBatch:
    """Rows prompt + response, right-padded, in groups sharing their prompt."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows, prompt_lengths = [], []
    for _ in range(rng.randrange(1, 6)):
        prompt = torch.randint(5, 50, (rng.randrange(1, 9),), generator=gen).tolist()
        for _ in range(rng.randrange(1, 7)):
            response = torch.randint(5, 50, (rng.choice([0, 1, 2, 5, 9]),), generator=gen)
            rows.append((prompt, response.tolist()))
            prompt_lengths.append(len(prompt))
    order = list(range(len(rows)))
    rng.shuffle(order)  # a prompt's rows need not be adjacent in the batch
    rows = [rows[i] for i in order]
    prompt_lengths = [prompt_lengths[i] for i in order]
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width)
    for i, (p, r) in enumerate(rows):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attention[i, :len(p) + len(r)] = 1
        loss_mask[i, len(p):len(p) + len(r)] = 1
    advantages = torch.randn(len(rows), 1, generator=gen) * loss_mask
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask,
                      old_logprobs=-torch.rand(ids.shape, generator=gen) * loss_mask,
                      advantages=advantages, sample_weights=torch.ones(len(rows)),
                      versions=torch.where(loss_mask > 0, 0, -1),
                      prompt_lengths=torch.tensor(prompt_lengths))


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


@pytest.mark.parametrize("seed", range(6))
def test_a_prompts_rows_share_one_pack_unless_a_bound_splits_them(seed):
    batch = grouped_batch(seed)
    by_prompt = {}
    for i, p in enumerate(batch.prompt_lengths.tolist()):
        by_prompt.setdefault((p, tuple(batch.input_ids[i, :p].tolist())), []).append(i)
    parts = micro_batches(batch, 64, share_prompts=True)
    where = {i: k for k, m in enumerate(parts) for i in m.rows.tolist()}
    for rows in by_prompt.values():
        answered = [i for i in rows if int(batch.loss_mask[i].sum()) > 0]
        assert len({where[i] for i in answered}) <= 1
    packs = sum(0 if m.packed is None else m.packed.input_ids.shape[0] for m in parts)
    shared = [rows for rows in by_prompt.values()
              if sum(int(batch.loss_mask[i].sum()) > 0 for i in rows) > 1]
    if shared:  # a prompt with two answered rows is packed once
        assert any(m.packed is not None for m in parts)
        assert packs < len(batch)
    # without sharing: the row layout, rows sorted by length
    plain = micro_batches(batch, 3)
    assert all(m.packed is None and len(m.rows) <= 3 for m in plain)


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

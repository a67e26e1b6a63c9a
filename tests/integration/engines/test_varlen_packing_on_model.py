"""The varlen layout (engines/training/packing.py) with the tiny model on the CPU.

The premise first, verified on the installed transformers rather than assumed (`sdpa` and
`eager`, given rows end to end with restarting `position_ids` and no mask, keep each row to
itself: masking_utils.find_packed_sequence_indices); then the varlen forward's log-probs and
gradients are the row layout's, the FSDP engine's step in varlen takes the plain full-batch
step, and a joined replica takes the varlen layout where its platform has the kernel and the
mask elsewhere. On the CPU the varlen layout runs through transformers' sdpa, which builds the
block mask itself: the CPU platform declares no variable-length attention (nothing is saved
there), so these tests use one that declares sdpa (packing_cases.SdpaVarlenCpu). (The layout
logic and the choice of attention, no model: test_varlen_packing.py.)
"""

import random

import pytest
import torch
from fsdp_helpers import assert_takes_the_plain_step, plain_logprobs, save_tiny_model
from packing_cases import LOSS, SdpaVarlenCpu, grouped_batch
from transformers import AutoModelForCausalLM

from eddyrl.engines.registry import load_engine_class
from eddyrl.engines.training.packing import micro_batches, micro_logprobs, place_rows
from eddyrl.hal.cpu import CpuPlatform


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_transformers_keeps_packed_rows_apart(model_dir, attention):
    """The premise of running the varlen layout on the CPU: no mask, positions restarting at 0,
    and each row's logits are its own (transformers detects the restarts from position_ids
    when no mask and no cache are given)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attention)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(5, 50, (n,), generator=gen) for n in (7, 1, 5, 1, 3)]
    with torch.no_grad():
        alone = [model(input_ids=r[None], use_cache=False).logits[0] for r in rows]
        packed = model(input_ids=torch.cat(rows)[None], use_cache=False,
                       position_ids=torch.cat([torch.arange(len(r)) for r in rows])[None]
                       ).logits[0]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("seed", [0, 1, 3, 5])  # batches of 15, 9, 8 and 18 rows
def test_varlen_log_probs_and_gradients_are_the_row_layouts(model_dir, seed):
    rng = random.Random(200 + seed)
    batch = grouped_batch(seed)
    size, bound = rng.randrange(1, 12), rng.choice([4, 16, 8192])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = plain_logprobs(model, batch.input_ids, batch.attention_mask, 0.9)
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(seed))
    (want * weights * batch.attention_mask).sum().backward()
    want_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    got = torch.full(batch.input_ids.shape, float("nan"))
    for micro in micro_batches(batch, size, varlen=True, max_packed_tokens=bound):
        logprobs = micro_logprobs(model, micro, 0.9).logprobs
        real = micro.batch.attention_mask.bool()
        (logprobs * weights[micro.rows, :logprobs.shape[1]] * real).sum().backward()
        place_rows(got, micro.rows, micro.batch, logprobs.detach())
    real = batch.attention_mask.bool()
    got = torch.where(real, got, 0.0)
    assert (got - want.detach())[real].abs().max().item() < 1e-5
    grads = _grads(model)
    assert (grads - want_grads).norm() <= 1e-5 * want_grads.norm()


def test_fsdp_step_in_varlen_takes_the_plain_full_batch_step(model_dir, tmp_path):
    batch = grouped_batch(7)
    engine = load_engine_class("train", "fsdp")(
        model_dir, SdpaVarlenCpu(), 0, 1, f"file://{tmp_path}/pg", lr=1e-3,
        micro_batch_size=5, share_prompts=True, attention="varlen", max_packed_tokens=40)
    try:
        assert engine.varlen and not engine.share_prompts
        assert all(m.packed is not None and m.packed.segments is None
                   for m in engine._micro_batches(batch))
        got_logprobs = torch.full(batch.input_ids.shape, float("nan"))
        metrics = engine.train_step(batch, LOSS, logprobs_out=got_logprobs)
    finally:
        engine.close()
    assert_takes_the_plain_step(model_dir, batch, LOSS, metrics, got_logprobs)


def test_a_joined_replica_takes_the_varlen_layout_where_it_can_and_the_mask_elsewhere(model_dir):
    from eddyrl.engines.training.replica import GradientReplica

    batch = grouped_batch(1)
    total = int(batch.loss_mask.sum())
    packed = GradientReplica(model_dir, SdpaVarlenCpu(), micro_batch_size=4, attention="varlen")
    # varlen on a platform without the kernel: the trainer refused it at start; a lent worker
    # (fp32) takes the mask rather than fail mid-run
    masked = GradientReplica(model_dir, CpuPlatform(), micro_batch_size=4, attention="varlen")
    assert packed.varlen and not masked.varlen and masked.share_prompts
    got, _ = packed.gradients(batch, LOSS, total)
    want, _ = masked.gradients(batch, LOSS, total)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")

"""The varlen layout (engines/training/packing.py) and the choice of attention
(engines/training/attention.py).

Layout logic, no model: every real token is placed once, positions restart at 0 at each row,
the gather indices point at the position predicting each token, and `max_packed_tokens` bounds
a sequence. With the tiny model on the CPU: the premise first, verified on the installed
transformers rather than assumed (`sdpa` and `eager`, given rows end to end with restarting
`position_ids` and no mask, keep each row to itself: masking_utils.find_packed_sequence_indices);
then the varlen forward's log-probs and gradients are the row layout's, and the FSDP engine's
step in varlen takes the plain full-batch step. On the CPU the varlen layout runs through
transformers' sdpa, which builds the block mask itself: the CPU platform declares no
variable-length attention (nothing is saved there), so these tests use one that declares sdpa.
"""

import random

import pytest
import torch
from fsdp_helpers import assert_takes_the_plain_step, plain_logprobs, save_tiny_model
from test_packing import LOSS, grouped_batch
from transformers import AutoModelForCausalLM

from eddyrl.engines.registry import load_engine_class
from eddyrl.engines.training.attention import attention_implementation
from eddyrl.engines.training.packing import micro_batches, micro_logprobs, place_rows, row_ends
from eddyrl.errors import ConfigError
from eddyrl.hal import distributed as hd
from eddyrl.hal.cpu import CpuPlatform


class SdpaVarlenCpu(CpuPlatform):
    """The CPU, declaring transformers' sdpa its variable-length attention: true of the
    installed transformers (test_transformers_keeps_packed_rows_apart), just not mask-free."""

    def varlen_attention(self, dtype):
        return "sdpa"


class Bf16OnlyVarlen(CpuPlatform):
    name = "bf16only"

    def varlen_attention(self, dtype):
        return "flash_attention_2" if dtype == torch.bfloat16 else None


# ---- layout logic ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_every_real_token_is_placed_once_with_positions_restarting(seed):
    rng = random.Random(seed)
    batch = grouped_batch(seed)
    size, bound = rng.randrange(1, 12), rng.choice([1, 7, 20, 8192])
    ends = row_ends(batch)
    parts = micro_batches(batch, size, varlen=True, max_packed_tokens=bound)
    assert sorted(i for m in parts for i in m.rows.tolist()) == list(range(len(batch)))
    for micro in parts:
        packed, rows = micro.packed, micro.rows.tolist()
        assert len(rows) <= size
        assert packed.segments is None and packed.attention_mask(None) is None
        lengths = [int(ends[i]) for i in rows]
        total = packed.input_ids.shape[1]
        assert packed.input_ids.shape == packed.position_ids.shape == (1, total)
        assert total == max(sum(lengths), 1)
        assert total <= bound or len([n for n in lengths if n]) == 1  # a longer row alone
        flat_ids, flat_pos = packed.input_ids[0], packed.position_ids[0]
        predicted = []  # the flat positions the rows' tokens are predicted at
        at = 0
        for k, (i, n) in enumerate(zip(rows, lengths)):
            assert torch.equal(flat_ids[at:at + n], batch.input_ids[i, :n])
            assert torch.equal(flat_pos[at:at + n], torch.arange(n))
            source = packed.source[k]
            assert source[0] == -1 and torch.all(source[max(n, 1):] == -1)
            for t in range(1, n):  # token t of the row is predicted where token t - 1 sits
                s = int(source[t])
                assert flat_ids[s + 1] == batch.input_ids[i, t] and flat_pos[s] == t - 1
                predicted.append(s)
            at += n
        # every position but each row's last predicts exactly one token of its own row
        lasts = {sum(lengths[:j + 1]) - 1 for j in range(len(lengths)) if lengths[j]}
        assert sorted(predicted) == [p for p in range(sum(lengths)) if p not in lasts]


def test_varlen_layout_ignores_share_prompts_and_cuts_rows_by_length():
    batch = grouped_batch(3)
    parts = micro_batches(batch, 4, share_prompts=True, varlen=True)
    ends = row_ends(batch)
    longest = [int(ends[m.rows].max()) for m in parts]
    assert longest == sorted(longest)
    for micro in parts:
        assert micro.batch.input_ids.shape[1] == max(int(ends[micro.rows].max()), 1)


def test_the_token_budget_bounds_a_varlen_sequence_as_the_pack_bound_does():
    batch = grouped_batch(6)
    ends = row_ends(batch)
    for options in (dict(max_packed_tokens=20), dict(max_tokens=20)):
        parts = micro_batches(batch, 64, varlen=True, **options)
        assert sorted(i for m in parts for i in m.rows.tolist()) == list(range(len(batch)))
        for micro in parts:
            assert micro.packed.input_ids.shape[1] <= max(20, int(ends[micro.rows].max()))


def test_a_micro_batch_of_empty_rows_runs_one_padding_position():
    batch = grouped_batch(0).select(torch.tensor([0, 1]))
    batch.attention_mask.zero_()
    (micro,) = micro_batches(batch, 8, varlen=True)
    assert micro.packed.input_ids.shape == (1, 1) and torch.all(micro.packed.source == -1)


# ---- the choice of attention -----------------------------------------------------------------
def test_auto_takes_the_platforms_varlen_attention_and_mask_never_does():
    cpu, sdpa = CpuPlatform(), SdpaVarlenCpu()
    assert attention_implementation("auto", cpu, torch.bfloat16) is None  # the dense mask
    assert attention_implementation("auto", sdpa, None) == "sdpa"
    assert attention_implementation("varlen", sdpa, torch.float32) == "sdpa"
    assert attention_implementation("mask", sdpa, torch.bfloat16) is None
    assert attention_implementation("auto", Bf16OnlyVarlen(), None) is None  # fp32: the mask
    assert attention_implementation("auto", Bf16OnlyVarlen(), torch.bfloat16) == \
        "flash_attention_2"


def test_varlen_without_the_platforms_kernel_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"train\.attention = 'varlen': platform 'cpu' has no "
                                          r"variable-length attention at float32; use auto"):
        attention_implementation("varlen", CpuPlatform(), None)
    with pytest.raises(ConfigError, match=r"platform 'bf16only' has no variable-length "
                                          r"attention at float32; it has flash_attention_2 in "
                                          r"bf16: set train.param_dtype=bf16"):
        attention_implementation("varlen", Bf16OnlyVarlen(), torch.float32)
    with pytest.raises(ConfigError, match="train.attention = 'flash'"):
        attention_implementation("flash", CpuPlatform(), None)


def test_the_fsdp_engine_refuses_varlen_on_the_cpu_before_joining_a_group(tmp_path):
    engine_class = load_engine_class("train", "fsdp")
    with pytest.raises(ConfigError, match="train.attention = 'varlen'"):
        engine_class(str(tmp_path), CpuPlatform(), 0, 1, f"file://{tmp_path}/pg",
                     attention="varlen")
    assert not hd.is_initialized()


# ---- with the tiny model ---------------------------------------------------------------------
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

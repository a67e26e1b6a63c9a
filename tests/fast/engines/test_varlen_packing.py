"""The varlen layout (engines/training/packing.py) and the choice of attention
(engines/training/attention.py), no model.

Layout logic: every real token is placed once, positions restart at 0 at each row, the gather
indices point at the position predicting each token, and `max_packed_tokens` bounds a
sequence. The choice of attention: `auto` takes the platform's variable-length attention where
it has one at the dtype, `mask` never does, `varlen` without the kernel is one clear error
(the FSDP engine's before it joins a group). (With the tiny model on the CPU:
test_varlen_packing_on_model.py.)
"""

import random

import pytest
import torch
from packing_cases import SdpaVarlenCpu, grouped_batch

from eddyrl.engines.registry import load_engine_class
from eddyrl.engines.training.attention import attention_implementation
from eddyrl.engines.training.packing import micro_batches, row_ends
from eddyrl.errors import ConfigError
from eddyrl.hal import distributed as hd
from eddyrl.hal.cpu import CpuPlatform


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

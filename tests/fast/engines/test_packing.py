"""Shared-prompt packing (engines/training/packing.py): which rows go into which pack.

Over seeded random batches of prompt groups (prompts of different lengths, 1 to 6 samples each,
responses of different lengths, some rows with no response; packing_cases.py): every answered
row of a prompt lands in one micro-batch unless a bound splits them, a prompt with two answered
rows is packed once, and without sharing the rows keep the row layout. (The packed forward's
log-probs and gradients, and the FSDP engine's step with packing: test_packing_on_model.py.)
"""

import pytest
from packing_cases import grouped_batch

from eddyrl.engines.training.packing import micro_batches


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

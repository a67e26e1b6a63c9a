"""Token-budget micro-batches (`train.max_tokens_per_micro_batch`, packing.py::micro_batches):
pure logic over seeded random batches, row and shared-prompt layouts. Each micro-batch's
forward holds at most the budget's tokens (padding included) unless it is one row longer than
the budget, every row lands in exactly one micro-batch, `micro_batch_size` still bounds the
rows, and a budget of 0 cuts exactly as before (rows only)."""

import random
import warnings

import pytest
import torch

from eddyrl.engines.training.packing import micro_batches
from eddyrl.protocol import TrainBatch


def grouped_batch(seed: int) -> TrainBatch:
    """Right-padded rows prompt + response, in groups sharing their prompt, shuffled."""
    rng = random.Random(seed)
    rows, prompts = [], []
    for _ in range(rng.randrange(1, 7)):
        prompt = [rng.randrange(5, 50) for _ in range(rng.randrange(1, 12))]
        for _ in range(rng.randrange(1, 7)):
            rows.append(prompt + [rng.randrange(5, 50) for _ in range(rng.choice([0, 1, 3, 9,
                                                                                   20]))])
            prompts.append(len(prompt))
    order = list(range(len(rows)))
    rng.shuffle(order)
    rows, prompts = [rows[i] for i in order], [prompts[i] for i in order]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width)
    for i, (row, p) in enumerate(zip(rows, prompts)):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
        loss_mask[i, p:len(row)] = 1
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask,
                      old_logprobs=torch.zeros(ids.shape), advantages=torch.zeros(ids.shape),
                      sample_weights=torch.ones(len(rows)),
                      versions=torch.where(loss_mask > 0, 0, -1),
                      prompt_lengths=torch.tensor(prompts))


def forward_tokens(micro) -> int:
    """The tokens the micro-batch's forward runs: its packed sequences, or its cut rows."""
    return (micro.packed.input_ids if micro.packed is not None else micro.batch.input_ids).numel()


def cut(batch, size, share, budget):
    """`share`: False (the row layout), True (shared prompts) or "varlen"."""
    layout = {"varlen": True} if share == "varlen" else {"share_prompts": share}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # rows over the budget: checked below
        return micro_batches(batch, size, max_tokens=budget, **layout)


@pytest.mark.parametrize("share", [False, True, "varlen"])
@pytest.mark.parametrize("seed", range(8))
def test_micro_batches_hold_the_token_budget_and_every_row_once(seed, share):
    rng = random.Random(seed)
    batch = grouped_batch(seed)
    size, budget = rng.randrange(1, 12), rng.choice([8, 24, 40, 100])
    ends = batch.attention_mask.sum(1)
    parts = cut(batch, size, share, budget)
    assert sorted(i for m in parts for i in m.rows.tolist()) == list(range(len(batch)))
    for micro in parts:
        assert len(micro.rows) <= size
        over = forward_tokens(micro) > budget
        # over the budget only as one row that alone exceeds it (a prompt's pack of rows is
        # split to fit)
        if over:
            assert len(micro.rows) == 1 and int(ends[micro.rows[0]]) > budget
    # the budget only splits: never fewer micro-batches than by rows alone
    assert len(parts) >= len(cut(batch, size, share, 0))


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_a_budget_of_zero_cuts_by_rows_as_before(seed, share):
    """0 is today's behaviour: the row layout in length order, chunks of `size` rows."""
    batch = grouped_batch(seed)
    size = random.Random(seed).randrange(1, 12)
    parts = cut(batch, size, share, 0)
    if not share:
        order = torch.argsort(batch.attention_mask.sum(1), stable=True)
        assert [m.rows.tolist() for m in parts] == [order[s:s + size].tolist()
                                                   for s in range(0, len(batch), size)]
    # a budget no micro-batch reaches cuts the same
    huge = cut(batch, size, share, 10 ** 9)
    assert [m.rows.tolist() for m in huge] == [m.rows.tolist() for m in parts]


def test_a_row_longer_than_the_budget_runs_alone_with_a_warning():
    batch = grouped_batch(3)
    ends = batch.attention_mask.sum(1)
    budget = int(ends.max()) - 1
    with pytest.warns(RuntimeWarning, match="max_tokens_per_micro_batch"):
        parts = micro_batches(batch, 64, max_tokens=budget)
    longest = [m for m in parts if int(ends[m.rows].max()) > budget]
    assert longest and all(len(m.rows) == 1 for m in longest)


def test_rows_by_tokens_fill_each_micro_batch_greedily():
    """Rows of 2, 2, 3, 3 and 8 tokens with a budget of 8: (2, 2, 3 cut at 3 -> 9 > 8, so
    2, 2), then (3, 3 -> 6), then 8 alone; rows 4 at most."""
    lengths = [8, 3, 2, 3, 2]
    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    batch = TrainBatch(input_ids=mask.clone(), attention_mask=mask, loss_mask=mask.float(),
                       old_logprobs=torch.zeros(mask.shape), advantages=torch.zeros(mask.shape),
                       sample_weights=torch.ones(len(lengths)), versions=mask - 1)
    parts = micro_batches(batch, 4, max_tokens=8)
    assert [m.rows.tolist() for m in parts] == [[2, 4], [1, 3], [0]]
    assert [forward_tokens(m) for m in parts] == [4, 6, 8]

"""Shared by the packing tests (shared-prompt and varlen, on their own and on the tiny model):
seeded random batches of prompt groups, the policy loss they train with, and a CPU platform
that declares a variable-length attention."""

import random

import torch

from eddyrl.core.losses import make_policy_loss
from eddyrl.hal.cpu import CpuPlatform
from eddyrl.protocol import TrainBatch

LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.0)


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


class SdpaVarlenCpu(CpuPlatform):
    """The CPU, declaring transformers' sdpa its variable-length attention: true of the
    installed transformers (test_transformers_keeps_packed_rows_apart in
    test_varlen_packing_on_model.py), just not mask-free."""

    def varlen_attention(self, dtype):
        return "sdpa"

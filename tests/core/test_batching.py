"""Groups -> training tensors: alignment, masks, advantages, and the token-balanced DP split."""

import torch

from eddyrl.core.batching import balanced_partition, build_train_batch, split_for_ranks
from eddyrl.core.trajectory import Group, Trajectory
from eddyrl.engines.inference.base import GenerationResult


def _group(gid, prompt_ids, responses, rewards, version=2):
    group = Group(gid, "p", "a", prompt_ids, version)
    for i, (tokens, reward) in enumerate(zip(responses, rewards)):
        result = GenerationResult(f"{gid}-{i}", prompt_ids, tokens,
                                  [-0.1 * (k + 1) for k in range(len(tokens))],
                                  [version] * len(tokens), "stop")
        group.trajectories.append(Trajectory(result, reward))
    return group


def test_rows_are_prompt_then_response_with_aligned_tensors():
    groups = [_group("a", [1, 2], [[7, 8, 9], [7]], [1.0, 0.0]),
              _group("b", [1, 2, 3], [[5, 6], [6, 6]], [0.0, 0.0])]
    batch = build_train_batch(groups, pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 7, 8, 9], [1, 2, 7, 0, 0],
                                        [1, 2, 3, 5, 6], [1, 2, 3, 6, 6]]
    assert batch.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0], [1] * 5, [1] * 5]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0],
                                        [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    torch.testing.assert_close(batch.old_logprobs[0], torch.tensor([0, 0, -0.1, -0.2, -0.3]))
    assert batch.versions[1].tolist() == [-1, -1, 2, -1, -1]
    # group a: rewards (1, 0) -> mean .5, unbiased std .7071 -> +-0.7071; group b: all zero
    torch.testing.assert_close(batch.advantages[0], torch.tensor([0, 0, 0.7071, 0.7071, 0.7071]),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(batch.advantages[1], torch.tensor([0, 0, -0.7071, 0, 0]),
                               atol=1e-4, rtol=0)
    assert batch.advantages[2:].abs().sum() == 0
    assert batch.num_tokens() == 3 + 1 + 2 + 2


def test_balanced_partition_balances_tokens_and_rows():
    counts = [100, 90, 10, 10, 5, 5]
    parts = balanced_partition(counts, 2)
    loads = [sum(counts[i] for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert [len(p) for p in parts] == [3, 3]
    assert abs(loads[0] - loads[1]) <= 20


def test_split_for_ranks_trims_padding_and_keeps_every_row():
    groups = [_group("a", [1], [[2] * 9, [2]], [1.0, 0.0]), _group("b", [1], [[3], [3]], [0.0, 1.0])]
    batch = build_train_batch(groups, pad_id=0)
    parts = split_for_ranks(batch, 2)
    assert sum(len(p) for p in parts) == 4
    assert sum(p.num_tokens() for p in parts) == batch.num_tokens()
    short = [p for p in parts if p.input_ids.shape[1] < batch.input_ids.shape[1]]
    assert short, "the part without the long row should be trimmed"

"""Groups -> training tensors: alignment, masks, advantages, and the token-balanced DP split."""

import pytest
import torch

from eddyrl.core.batching import build_train_batch, split_for_ranks
from eddyrl.core.partition import balanced_partition
from eddyrl.protocol import GenerationResult, Group, Trajectory


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


def _episode_group(env_logprob):
    """One multi-turn response: 2 generated tokens, 2 environment tokens (log-probs are
    placeholders, here `env_logprob`), 1 generated token; and a single-turn response."""
    group = Group("e", "p", "a", [1, 2], 3)
    tokens, mask = [7, 8, 30, 31, 9], [1, 1, 0, 0, 1]
    logprobs = [-0.5, -0.7, env_logprob, env_logprob, -0.9]
    episode = GenerationResult("e-0", [1, 2], tokens, logprobs, [3, 3, 3, 3, 4], "stop",
                               loss_mask=mask)
    single = GenerationResult("e-1", [1, 2], [7, 9], [-0.2, -0.4], [3, 3], "stop")
    group.trajectories = [Trajectory(episode, 1.0), Trajectory(single, 0.0)]
    return group


def test_environment_tokens_are_masked_out_of_the_row_and_the_loss():
    from eddyrl.core.losses import make_policy_loss

    batch = build_train_batch([_episode_group(0.0)], pad_id=0)
    assert batch.input_ids[0].tolist() == [1, 2, 7, 8, 30, 31, 9]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 0, 0, 0]]
    assert batch.versions[0].tolist() == [-1, -1, 3, 3, -1, -1, 4]
    assert (batch.advantages[0, 4:6] == 0).all() and (batch.advantages[0, 2:4] > 0).all()
    assert batch.num_tokens() == 3 + 2
    assert _episode_group(0.0).trajectories[0].num_generated == 3

    loss_fn = make_policy_loss(clip_low=0.2, clip_high=0.28)

    def loss_and_grad(env_logprob, current_env_logprob):
        batch = build_train_batch([_episode_group(env_logprob)], pad_id=0)
        current = batch.old_logprobs.clone() + 0.1 * torch.arange(7.0)  # ratios != 1
        current[0, 4:6] = current_env_logprob  # what the trainer computes there: anything
        current.requires_grad_(True)
        loss, _ = loss_fn(current, batch, batch.num_tokens())
        loss.backward()
        return loss.item(), current.grad

    base, grad = loss_and_grad(0.0, 0.0)
    assert grad[0, 4:6].abs().sum() == 0 and grad[0, 2:4].abs().sum() > 0
    # neither the placeholder behaviour log-probs nor the trainer's values at environment
    # tokens change the loss
    for env_logprob, current_env_logprob in [(-7.0, 0.0), (0.0, -30.0), (-3.0, 5.0)]:
        loss, other_grad = loss_and_grad(env_logprob, current_env_logprob)
        assert loss == pytest.approx(base, abs=1e-7)
        torch.testing.assert_close(other_grad, grad)


def test_a_loss_mask_of_the_wrong_length_is_refused():
    group = _episode_group(0.0)
    group.trajectories[0].result.loss_mask = [1, 0]
    with pytest.raises(ValueError, match="loss mask of 2 for 5 tokens"):
        build_train_batch([group], pad_id=0)

"""Group-normalised advantages and the DAPO filter, against values worked out by hand."""

import pytest
import torch

from eddyrl.core.advantages import (broadcast_to_tokens, group_advantages, informative_groups,
                                    is_informative)


def test_grpo_normalises_within_each_group():
    # Group [0, 2, 4]: mean 2, unbiased std sqrt((4 + 0 + 4) / 2) = 2 -> [-1, 0, 1].
    # Group [3, 3, 3]: all equal -> centred 0, divided by (0 + eps) -> 0, not NaN.
    rewards = torch.tensor([0.0, 2.0, 4.0, 3.0, 3.0, 3.0])
    adv = group_advantages(rewards, group_size=3)
    assert torch.allclose(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), atol=1e-5)


def test_binary_rewards_group_of_four():
    # [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735,
    # so A = +-0.5 / 0.57735 = +-0.866025
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    assert torch.allclose(adv, torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)


def test_dr_grpo_skips_the_std_division():
    # Group [0, 2, 4] centred: [-2, 0, 2] (the std of 2 is not divided out).
    adv = group_advantages(torch.tensor([0.0, 2.0, 4.0]), group_size=3, normalize_std=False)
    assert torch.equal(adv, torch.tensor([-2.0, 0.0, 2.0]))


def test_two_dimensional_input_keeps_its_shape_and_single_response_groups_get_zero():
    adv = group_advantages(torch.tensor([[0.0, 2.0, 4.0], [1.0, 1.0, 4.0]]), group_size=3)
    assert adv.shape == (2, 3)
    # [1, 1, 4]: mean 2, centred [-1, -1, 2], std sqrt((1 + 1 + 4) / 2) = sqrt(3) = 1.732051
    assert torch.allclose(adv[1], torch.tensor([-0.577350, -0.577350, 1.154701]), atol=1e-5)
    assert torch.equal(group_advantages(torch.tensor([5.0, 7.0]), group_size=1), torch.zeros(2))


def test_rewards_must_split_into_whole_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_broadcast_puts_the_sequence_advantage_on_its_loss_tokens_only():
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.tensor([1.0]), mask)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    rewards = torch.tensor([0.0, 2.0, 4.0, 3.0, 3.0, 3.0, 1.0, 1.0, 0.0])
    assert informative_groups(rewards, group_size=3).tolist() == [True, False, True]
    assert is_informative([0.0, 1.0]) and is_informative(torch.tensor([1.0, 1.0, 0.0]))
    assert not is_informative([1.0, 1.0, 1.0])
    assert not is_informative([5.0])  # one response: no comparison, nothing to learn

"""GRPO-family advantages: one scalar per response, normalised within its prompt group.

A group is the G responses sampled for one prompt, stored contiguously (rows g*G .. g*G+G-1).
GRPO: A_i = (r_i - mean(r)) / (std(r) + eps). Dr.GRPO drops the std division
(`normalize_std=False`), because dividing by a small std up-weights near-solved and near-failed
prompts. The std is the unbiased (N-1) one, as in the GRPO reference implementations (TRL, verl).

DAPO's dynamic sampling keeps only informative groups: a group whose rewards are all equal has
all-zero advantages, so it adds tokens to the normalisation count and nothing to the gradient.
"""

from __future__ import annotations

import torch


def _as_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] flat rewards -> [N // G, G]; a [num_groups, G] tensor is returned unchanged."""
    if rewards.dim() == 2:
        return rewards
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N] or [num_groups, G], not {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages, same shape as `rewards` ([N] flat, or [num_groups, G]).

    A group of one has no baseline to compare against: its advantage is 0.
    """
    groups = _as_groups(rewards.float(), group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and groups.shape[1] > 1:
        centred = centred / (groups.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centred.reshape(rewards.shape)


def broadcast_to_tokens(seq_advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] per-response advantages -> [B, L] per-token advantages, 0 off the loss mask."""
    if seq_advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"{seq_advantages.shape[0]} advantages for {loss_mask.shape[0]} rows")
    return seq_advantages.to(loss_mask.dtype if loss_mask.is_floating_point() else torch.float32
                             ).unsqueeze(1) * loss_mask


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: True where the group's rewards are not all equal (DAPO filter)."""
    groups = _as_groups(rewards, group_size)
    return (groups != groups[:, :1]).any(dim=1)


def is_informative(group_rewards: torch.Tensor | list[float]) -> bool:
    """One group: keep it for training iff its rewards are not all equal."""
    rewards = torch.as_tensor(group_rewards)
    return bool(rewards.numel() > 1 and (rewards != rewards.reshape(-1)[0]).any())

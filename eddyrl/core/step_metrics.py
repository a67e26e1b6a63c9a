"""What a step reports about the groups it generated, and how counters grew over a step."""

from __future__ import annotations

from typing import Any

from .trajectory import Group


def counters_since(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters' growth since `before` (environment statistics of one step)."""
    return {name: value - before.get(name, 0.0) for name, value in now.items()}


def rollout_metrics(groups: list[Group], reward_errors: int) -> dict[str, Any]:
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajectories] or [0.0]
    lengths = [t.num_tokens for t in trajectories] or [0]  # environment tokens included
    prompts = [len(t.result.prompt_ids) for t in trajectories] or [0]
    return {"reward_mean": sum(rewards) / len(rewards),
            "train_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "response_len_mean": sum(lengths) / len(lengths),
            "response_len_max": max(lengths),
            "gen_tokens": sum(t.num_generated for t in trajectories),
            "prompt_len_mean": sum(prompts) / len(prompts),
            "groups_generated": len(groups), "reward_errors": reward_errors}

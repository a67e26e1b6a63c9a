"""Trajectories and groups: a prompt's G responses, their rewards, and what produced them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engines.inference.base import GenerationResult


@dataclass(slots=True)
class Trajectory:
    result: GenerationResult
    reward: float = 0.0
    reward_error: str | None = None  # set when the reward function failed on this sample

    @property
    def num_tokens(self) -> int:
        """The response's tokens, environment tokens of a multi-turn episode included."""
        return len(self.result.token_ids)

    @property
    def num_generated(self) -> int:
        """The tokens the policy generated (the trained ones)."""
        mask = self.result.loss_mask
        return self.num_tokens if mask is None else sum(mask)


@dataclass(slots=True)
class Group:
    """One prompt and its responses; trained, replayed and accounted for as a whole."""

    group_id: str
    prompt: str
    answer: str
    prompt_ids: list[int]
    dispatch_version: int
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def is_informative(self) -> bool:
        """Whether GRPO learns anything from it: rewards that are not all equal."""
        rewards = self.rewards
        return len(rewards) > 1 and max(rewards) > min(rewards)

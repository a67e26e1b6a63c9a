"""Reward functions for tests: with a random tiny model the task reward is always 0, so tests
that need a learning signal use one that differs between any two responses."""


def length_reward(response: str, answer: str) -> float:
    return len(response) / 50.0


def zero(response: str, answer: str) -> float:
    """The same reward for every response: nothing to learn from (issue 34, item 1)."""
    return 0.0


def digit_share(response: str, answer: str) -> float:
    """The share of the response's characters that are digits: a second reward for runs with
    several (`data.rewards`), differing between responses as length_reward does."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)

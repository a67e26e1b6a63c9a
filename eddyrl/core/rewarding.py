"""Calling a user's reward function safely: a failure costs one sample, never the run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ..plugins import load_reward_fn  # noqa: F401  (where callers load data.reward_fn from)

RewardFn = Callable[[str, str], float]


@dataclass
class SafeReward:
    """Wraps a reward function: an exception or a non-finite value gives reward 0, the error
    is recorded on the sample and counted, and the run goes on."""

    fn: RewardFn
    errors: int = 0
    last_errors: list[str] = field(default_factory=list)

    def __call__(self, response: str, answer: str) -> tuple[float, str | None]:
        try:
            value = float(self.fn(response, answer))
        except Exception as exc:  # user code: any failure is this sample's, not the run's
            return self._fail(f"{type(exc).__name__}: {exc}")
        if not math.isfinite(value):
            return self._fail(f"reward function returned {value}")
        return value, None

    def _fail(self, message: str) -> tuple[float, None | str]:
        self.errors += 1
        self.last_errors = (self.last_errors + [message])[-5:]
        return 0.0, message

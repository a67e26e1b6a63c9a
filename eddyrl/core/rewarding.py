"""Calling a user's reward function safely: a failure costs one sample, never the run."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError

RewardFn = Callable[[str, str], float]


def load_reward_fn(dotted: str, key: str = "data.reward_fn") -> RewardFn:
    """`package.module:function`, checked to be callable, with a clear error otherwise."""
    module_name, _, attr = dotted.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"config key {key!r} = {dotted!r}: module {module_name!r} cannot be "
                          f"imported ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"config key {key!r} = {dotted!r}: {module_name} has no callable "
                          f"{attr!r}")
    return fn


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

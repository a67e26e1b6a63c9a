"""Config section `env`: which environment multi-turn episodes run in, and their limits.

    env:
      name: calculator          # null: single-turn (no environment); calculator | python |
                                # 'package.module:Name' (an Environment subclass or factory)
      max_turns: 4
      max_observation_tokens: 256
      step_timeout_s: 60
      options: {syntax: tiny}   # keyword arguments of the environment

Bundled environments score the final answer with the run's reward (`data.reward_fn`, or
`data.rewards` summed with their weights) unless `options.reward_fn` names another; a custom
environment gets exactly its `options`. `build` checks everything at start-up, including one
trial construction (so constructing an environment must be cheap and do no I/O; do that in
`respond`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import ConfigError
from ..plugins import load_reward_fn
from ..validation import check_range, did_you_mean
from .base import DEFAULT_PAYLOAD_BYTES, EpisodeLimits
from .loading import EnvironmentFactory, load_environment

BUNDLED = {"calculator": "eddyrl.envs.calculator:CalculatorEnv",
           "python": "eddyrl.envs.python_tool:PythonEnv"}


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    name: str | None = None
    max_turns: int = 4
    max_observation_tokens: int = 256  # environment tokens per episode
    step_timeout_s: float = 60.0
    cutoff_reward: float = 0.0  # an episode cut by a limit or an environment error
    options: dict[str, Any] = field(default_factory=dict)

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.max_turns", self.max_turns, 1)
        check_range(f"{prefix}.max_observation_tokens", self.max_observation_tokens, 1)
        check_range(f"{prefix}.step_timeout_s", self.step_timeout_s, 0, lo_open=True)
        if self.name is not None and ":" not in self.name and self.name not in BUNDLED:
            raise ConfigError(f"config key '{prefix}.name' = {self.name!r} is neither a bundled "
                              f"environment ({', '.join(BUNDLED)}) nor a dotted path "
                              f"'package.module:Name'{did_you_mean(self.name, BUNDLED)}")

    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(max_turns=self.max_turns,
                             max_observation_tokens=self.max_observation_tokens,
                             step_timeout_s=self.step_timeout_s,
                             cutoff_reward=self.cutoff_reward)

    def build(self, prefix: str, *, tokenizer, reward_fn: str | Callable[[str, str], float],
              payload_bytes: Sequence[int] = DEFAULT_PAYLOAD_BYTES
              ) -> EnvironmentFactory | None:
        """The episode factory, or None for single-turn. `reward_fn` is the run's reward, loaded
        (`rewarding.load_reward`: several rewards are one callable) or as `data.reward_fn`
        names it; `payload_bytes` is `routing.payload_bytes`. ConfigError naming the key on a
        problem."""
        if self.name is None:
            return None
        self.validate(prefix)
        options = dict(self.options)
        if self.name in BUNDLED:
            chosen = options.get("reward_fn", reward_fn)
            key = f"{prefix}.options.reward_fn" if "reward_fn" in options else "data.reward_fn"
            options["reward_fn"] = load_reward_fn(chosen, key) if isinstance(chosen, str) \
                else chosen
        factory = load_environment(BUNDLED.get(self.name, self.name), f"{prefix}.name",
                                   tokenizer=tokenizer, limits=self.limits(),
                                   payload_bytes=tuple(payload_bytes), **options)
        try:  # options the signature cannot judge (a syntax's name)
            factory(prompt="", answer="")
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"config key '{prefix}.name' = {self.name!r}: building an "
                              f"environment failed ({type(exc).__name__}: {exc})") from None
        return factory

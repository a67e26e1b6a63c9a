"""Config section of the prompt data and the reward."""

from __future__ import annotations

from dataclasses import dataclass

from ..validation import check_choice, check_range, contradiction
from ..errors import ConfigError


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: str = "arith"  # the built-in synthetic task, generated when no paths are given
    train_path: str | None = None  # JSONL rows {"prompt": str, "answer": str, ...}
    eval_path: str | None = None
    train_size: int = 20000  # rows generated for the built-in task
    eval_size: int = 500
    reward_fn: str = "eddyrl.tasks.reward:reward"  # dotted path: fn(response, answer) -> float
    max_prompt_tokens: int = 96
    prompt_overflow: str = "error"  # a longer prompt: "error", or "truncate" (keep the end)

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.task", self.task, ["arith"])
        check_range(f"{prefix}.train_size", self.train_size, 1)
        check_range(f"{prefix}.eval_size", self.eval_size, 1)
        check_range(f"{prefix}.max_prompt_tokens", self.max_prompt_tokens, 1)
        check_choice(f"{prefix}.prompt_overflow", self.prompt_overflow, ["error", "truncate"])
        if ":" not in self.reward_fn:
            raise ConfigError(f"config key '{prefix}.reward_fn' = {self.reward_fn!r} must be a "
                              "dotted path of the form 'package.module:function'")
        if (self.train_path is None) != (self.eval_path is None):
            raise contradiction(f"{prefix}.train_path and {prefix}.eval_path must be given "
                                "together (or neither, to generate the built-in task)")

"""Config section of the prompt data and the reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..validation import check_choice, check_range, contradiction
from ..errors import ConfigError
from .dataset import check_suffix
from .formats import FORMATS


# The built-in synthetic tasks, generated when no data files are given (tasks/builtin.py):
# `arith` (tasks/arith.py, single-turn), `cipher` (tasks/cipher.py: encipher a word with a fixed
# key, scored by CIPHER_REWARD; the task with headroom, `eddy train cipher_tiny`) and `tool_add`
# (tasks/tool_task.py: sums too long to add without the calculator environment,
# `env.name = calculator`).
TASKS = ("arith", "cipher", "tool_add")
ARITH_REWARD = "eddyrl.tasks.reward:reward"
CIPHER_REWARD = "eddyrl.tasks.cipher:reward"


PromptOverflow = Literal["error", "truncate"]


@dataclass(kw_only=True, slots=True)
class DataFields:
    """Where a row keeps its prompt and answer, as dotted paths into the row (e.g.
    `reward_model.ground_truth`); None: the name `data.format` uses."""

    prompt: str | None = None
    answer: str | None = None

    def validate(self, prefix: str) -> None:
        for name in ("prompt", "answer"):
            value = getattr(self, name)
            if value is not None and (not value or any(not p for p in value.split("."))):
                raise ConfigError(f"config key '{prefix}.{name}' = {value!r} must be a field "
                                  "name or a dotted path such as 'reward_model.ground_truth'")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: str = "arith"  # the built-in synthetic task (TASKS), generated when no paths are given
    # .jsonl / .json (JSON lines) or .parquet files; rows laid out as `format` says
    train_path: str | None = None
    eval_path: str | None = None
    format: str = "plain"  # plain {prompt, answer} | gsm8k | dapo_math (tasks/formats.py)
    fields: DataFields = field(default_factory=DataFields)  # overrides the format's field names
    train_size: int = 20000  # rows generated for the built-in task
    eval_size: int = 500
    reward_fn: str = ARITH_REWARD  # dotted path: fn(response, answer) -> float
    # A reward call running longer scores 0, counted in reward_errors (None: no limit)
    reward_timeout_s: float | None = 60.0
    max_prompt_tokens: int = 96
    prompt_overflow: PromptOverflow = "error"  # a longer prompt: "error", or "truncate" (keep the end)

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.task", self.task, list(TASKS))
        check_choice(f"{prefix}.format", self.format, list(FORMATS))
        self.fields.validate(f"{prefix}.fields")
        check_range(f"{prefix}.train_size", self.train_size, 1)
        check_range(f"{prefix}.eval_size", self.eval_size, 1)
        check_range(f"{prefix}.max_prompt_tokens", self.max_prompt_tokens, 1)
        check_choice(f"{prefix}.prompt_overflow", self.prompt_overflow, get_args(PromptOverflow))
        if self.reward_timeout_s is not None:
            check_range(f"{prefix}.reward_timeout_s", self.reward_timeout_s, 0, lo_open=True)
        if ":" not in self.reward_fn:
            raise ConfigError(f"config key '{prefix}.reward_fn' = {self.reward_fn!r} must be a "
                              "dotted path 'package.module:function' or a file's "
                              "'path/to/file.py:function'")
        if (self.train_path is None) != (self.eval_path is None):
            raise contradiction(f"{prefix}.train_path and {prefix}.eval_path must be given "
                                "together (or neither, to generate the built-in task)")
        if self.train_path is None and self.task == "cipher" and self.reward_fn == ARITH_REWARD:
            raise contradiction(f"{prefix}.task = cipher answers with a word, which the arith "
                                f"reward ({ARITH_REWARD}) scores 0; set {prefix}.reward_fn = "
                                f"{CIPHER_REWARD} (as the bundled config cipher_tiny does)")
        if self.train_path is None:
            custom = (self.format != "plain" or self.fields.prompt is not None
                      or self.fields.answer is not None)
            if custom:
                raise contradiction(f"{prefix}.format / {prefix}.fields describe data files, "
                                    f"but {prefix}.train_path and {prefix}.eval_path are not "
                                    "set (the built-in task is always 'plain')")
            return
        for key in ("train_path", "eval_path"):
            try:
                check_suffix(getattr(self, key))
            except ValueError as error:
                raise ConfigError(f"config key '{prefix}.{key}': {error}") from None

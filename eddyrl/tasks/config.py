"""Config section of the prompt data and the reward."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ..validation import check_choice, check_range, contradiction, did_you_mean
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


@dataclass(frozen=True, slots=True)
class RewardSpec:
    """One entry of `data.rewards`, checked: a reward function (as `data.reward_fn` names
    one), its weight in the sum and the name its metrics are logged under."""

    fn: str
    weight: float
    name: str


REWARD_KEYS = ("fn", "weight", "name")
# a name goes into metric keys (`reward/<name>`) and TensorBoard tags
_REWARD_NAME = re.compile(r"[A-Za-z0-9_.-]+")


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
    # Several rewards instead, summed: [{fn, weight (1.0), name (the function's)}] gives
    # sum(weight * fn(response, answer)), each logged as reward/<name>; the first is the one
    # accuracy counts (list the correctness reward first). Empty: `reward_fn` alone.
    # Free-form entries, checked by `reward_specs` (a typed list's errors would not name them).
    rewards: list[Any] = field(default_factory=list)
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
        if self.rewards and self.reward_fn != ARITH_REWARD:
            raise contradiction(f"{prefix}.reward_fn = {self.reward_fn!r} and {prefix}.rewards "
                                "are both set: give the reward functions in one place (list "
                                f"{self.reward_fn!r} as an entry of {prefix}.rewards)")
        self.reward_specs(prefix)
        if (self.train_path is None) != (self.eval_path is None):
            raise contradiction(f"{prefix}.train_path and {prefix}.eval_path must be given "
                                "together (or neither, to generate the built-in task)")
        if self.train_path is None and self.task == "cipher" and not self.rewards and \
                self.reward_fn == ARITH_REWARD:
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

    def reward_specs(self, prefix: str = "data") -> list[RewardSpec]:
        """`rewards` checked, with their defaults; ConfigError naming the entry's key
        (`data.rewards[1].weight`) on a problem. Empty: the run has `reward_fn` alone."""
        specs = [_reward_spec(f"{prefix}.rewards[{i}]", entry)
                 for i, entry in enumerate(self.rewards)]
        first: dict[str, int] = {}
        for index, spec in enumerate(specs):
            if spec.name in first:
                raise ConfigError(
                    f"config keys '{prefix}.rewards[{first[spec.name]}]' and "
                    f"'{prefix}.rewards[{index}]' are both named {spec.name!r}: each reward is "
                    f"logged under its name (reward/<name>); give one a 'name'")
            first[spec.name] = index
        if specs and not any(spec.weight for spec in specs):
            raise ConfigError(f"config key '{prefix}.rewards': every weight is 0, so every "
                              "response would score 0 and nothing would train; give the "
                              "rewards that count a non-zero weight")
        return specs


def _reward_spec(key: str, entry: Any) -> RewardSpec:
    """One `data.rewards` entry, `{fn, weight, name}`, checked."""
    if not isinstance(entry, dict):
        raise ConfigError(f"config key {key!r} = {entry!r} must be a mapping {{fn: "
                          "'package.module:function', weight: 1.0, name: ...}")
    for name in entry:
        if name not in REWARD_KEYS:
            raise ConfigError(f"unknown config key '{key}.{name}' (valid keys here: "
                              f"{', '.join(REWARD_KEYS)}){did_you_mean(str(name), REWARD_KEYS)}")
    fn = entry.get("fn")
    if fn is None:
        raise ConfigError(f"config key '{key}.fn' is missing: each reward names its function, "
                          "fn: 'package.module:function' or 'path/to/file.py:function'")
    if not isinstance(fn, str) or ":" not in fn:
        raise ConfigError(f"config key '{key}.fn' = {fn!r} must be a dotted path "
                          "'package.module:function' or a file's 'path/to/file.py:function'")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ConfigError(f"config key '{key}.weight' = {weight!r} must be a number")
    if not math.isfinite(weight):
        raise ConfigError(f"config key '{key}.weight' = {weight!r} is not a finite number; "
                          "give a finite weight")
    name = entry.get("name")
    if name is None:
        name = fn.rpartition(":")[2].rpartition(".")[2]  # the function's own name
    elif not isinstance(name, str) or not _REWARD_NAME.fullmatch(name):
        raise ConfigError(f"config key '{key}.name' = {name!r} must be letters, digits, '_', "
                          "'.' or '-' (it names the metric reward/<name>)")
    return RewardSpec(fn=fn, weight=float(weight), name=name)

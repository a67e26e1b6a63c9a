"""A user's prompt -> response file made ready for `eddy sft --data FILE`: read as the RL data
files are (JSON lines or Parquet, `tasks/dataset.py`), checked row by row, tokenized with the
prompt exactly as a rollout will render it afterwards (`prompts.prompts_ids`: the model's chat
template ending in the assistant header, or plain text without one), held to a maximum length,
split into training and held-out rows, and served in seeded epochs.

Every refusal is a ConfigError naming the file, the 1-based row and the key, so a bad row fails
before the model is trained, not after.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, Iterator

from ..errors import ConfigError
from ..validation import did_you_mean
from .dataset import check_suffix, read_records
from .formats import RowError, check_prompt
from .prompts import prompts_ids
from .sft import IGNORE_INDEX, episode_tokens

OVERFLOWS = ("error", "truncate")


@dataclass(frozen=True, slots=True)
class SftFileConfig:
    """How `eddy sft` reads a user's file: where each row keeps its prompt (a string, or a
    list of chat messages `{"role", "content"}`) and its response (a string), a dotted key
    looking inside nested objects; the longest prompt + response in tokens, and what a longer
    row gets (`error`: refused; `truncate`: its response's end is cut); the share of rows held
    out to measure the loss on rows not trained on. `max_length` None: the model's own limit,
    which `tasks/sft_user.py` reads from its config.json."""

    prompt_key: str = "prompt"
    response_key: str = "response"
    max_length: int | None = None
    overflow: str = "error"
    eval_fraction: float = 0.0

    def validate(self) -> None:
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"eddy sft --max-length {self.max_length}: must be at least 2 "
                              "(a prompt token and a response token)")
        if self.overflow not in OVERFLOWS:
            raise ConfigError(f"eddy sft --overflow {self.overflow!r}: choose one of "
                              f"{', '.join(OVERFLOWS)}{did_you_mean(self.overflow, OVERFLOWS)}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eddy sft --eval-fraction {self.eval_fraction}: must be in "
                              "[0, 1) (0: no held-out rows)")


@dataclass(frozen=True, slots=True)
class Example:
    row: int  # 1-based row of the file (a line number for JSON lines)
    ids: tuple[int, ...]  # prompt, response, end token
    labels: tuple[int, ...]  # IGNORE_INDEX on the prompt: the loss is on the response only
    truncated: bool

    @property
    def response_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass(frozen=True, slots=True)
class SftData:
    source: str
    train: list[Example]
    held_out: list[Example]

    @property
    def tokens(self) -> int:
        return sum(len(e.ids) for e in self.train)

    @property
    def response_tokens(self) -> int:
        return sum(e.response_tokens for e in self.train)

    @property
    def truncated(self) -> int:
        return sum(e.truncated for e in self.train + self.held_out)


def load_sft_data(path: str | Path, tokenizer, config: SftFileConfig, seed: int) -> SftData:
    """The rows of `path`, checked and tokenized for `tokenizer`, split by `config` (its
    `max_length` set: `tasks/sft_user.py` resolves None against the model)."""
    config.validate()
    if config.max_length is None:
        raise ValueError("SftFileConfig.max_length: resolve it against the model first")
    rows = read_demonstrations(path, config.prompt_key, config.response_key)
    examples = tokenize_demonstrations(tokenizer, rows, str(path), config.max_length,
                                       config.overflow)
    train, held_out = split_held_out(examples, config.eval_fraction, seed, str(path))
    return SftData(str(path), train, held_out)


def read_demonstrations(path: str | Path, prompt_key: str, response_key: str
                        ) -> list[tuple[int, str | list[dict], str]]:
    """(row, prompt, response) of every row of a JSON lines or Parquet file."""
    path = Path(path)
    try:
        check_suffix(path)
        if not path.is_file():
            raise ValueError(f"data file '{path}' does not exist"
                             + (" (it is a directory)" if path.is_dir() else ""))
        rows = []
        for row, record in read_records(path):
            if not isinstance(record, dict):
                raise ConfigError(f"{path}: row {row}: expected a JSON object (one per line), "
                                  f"got {type(record).__name__}")
            prompt = _prompt(_field(record, prompt_key, path, row, "--prompt-key"),
                             prompt_key, path, row)
            response = _field(record, response_key, path, row, "--response-key")
            if not isinstance(response, str):
                raise ConfigError(f"{path}: row {row}: key {response_key!r} must be a string, "
                                  f"got {type(response).__name__}")
            if not response.strip():
                raise ConfigError(f"{path}: row {row}: key {response_key!r} is empty: nothing "
                                  "to learn from (remove the row, or fill in its response)")
            rows.append((row, prompt, response))
    except ConfigError:
        raise
    except ValueError as error:  # the readers' own, naming the file and row
        raise ConfigError(f"eddy sft --data: {error}") from None
    if not rows:
        raise ConfigError(f"eddy sft --data: data file '{path}' holds no rows")
    return rows


def _field(record: dict, key: str, path: Path, row: int, flag: str) -> Any:
    """`record[key]`, a dotted key looking inside nested objects; a ConfigError naming the
    row's keys (with a did-you-mean) when it is not there."""
    value: Any = record
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            inside = ".".join(parts[:depth])
            keys = list(value) if isinstance(value, dict) else []
            where = f"the keys of {inside!r}" if inside else "the row's keys"
            shown = ", ".join(map(repr, keys[:12])) + (", ..." if len(keys) > 12 else "")
            what = (f"{where}: {shown}" if keys else
                    f"{inside!r} is {type(value).__name__}, not an object")
            raise ConfigError(f"{path}: row {row}: no key {key!r}{did_you_mean(part, keys)} "
                              f"({what}); give {flag} KEY if the rows keep it under another "
                              "name")
        value = value[part]
    return value


def _prompt(value: Any, key: str, path: Path, row: int) -> str | list[dict]:
    """A prompt as the RL data files hold it (the readers' own rule, `formats.check_prompt`)."""
    try:
        return check_prompt(value, key)
    except RowError as error:
        raise ConfigError(f"{path}: row {row}: {error}") from None


def tokenize_demonstrations(tokenizer, rows: list[tuple[int, Any, str]], source: str,
                            max_length: int, overflow: str) -> list[Example]:
    """Each row's prompt ids (as a rollout renders them, all prompts as one batch) followed by
    its response's ids and the end token, labels on the response and end token only. A row
    longer than `max_length` tokens is refused (`overflow="error"`) or has its response's
    end cut (`"truncate"`); one whose prompt leaves no room for a response token is refused
    either way."""
    examples = []
    all_prompt_ids = prompts_ids(tokenizer, [prompt for _, prompt, _ in rows])
    for (row, _, response), prompt in zip(rows, all_prompt_ids):
        ids, labels = episode_tokens(tokenizer, prompt, [("model", response)])
        truncated = len(ids) > max_length
        if truncated and (overflow == "error" or len(prompt) >= max_length):
            why = (f"its prompt alone is {len(prompt)} tokens, which leaves no room for the "
                   "response: raise --max-length, or shorten the prompt"
                   if len(prompt) >= max_length else
                   f"it is {len(ids)} tokens ({len(prompt)} prompt, {len(ids) - len(prompt)} "
                   "response and end token): raise --max-length, or give --overflow truncate "
                   "to cut the response's end")
            raise ConfigError(f"{source}: row {row}: longer than --max-length {max_length}; "
                              f"{why}")
        examples.append(Example(row, tuple(ids[:max_length]), tuple(labels[:max_length]),
                                truncated))
    return examples


def split_held_out(examples: list[Example], fraction: float, seed: int, source: str
                   ) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples: a seeded random `fraction` of the rows held out (at
    least one when `fraction` > 0), the rest in file order."""
    if fraction <= 0:
        return examples, []
    held_count = max(1, round(len(examples) * fraction))
    if held_count >= len(examples):
        raise ConfigError(f"eddy sft --eval-fraction {fraction}: holds out {held_count} of the "
                          f"{len(examples)} rows of {source}, leaving none to train on")
    order = list(range(len(examples)))
    random.Random(f"{seed}-held-out").shuffle(order)
    held = set(order[:held_count])
    return ([e for i, e in enumerate(examples) if i not in held],
            [e for i, e in enumerate(examples) if i in held])


def steps_per_epoch(rows: int, batch_size: int) -> int:
    return -(-rows // batch_size)


def epoch_batches(examples: list[Example], batch_size: int, seed: int
                  ) -> Iterator[list[Example]]:
    """Endless batches; each epoch is a new seeded permutation of the examples (as the RL
    prompts are drawn), and its last, partial batch is served too: every row once an epoch."""
    for epoch in count():
        order = list(range(len(examples)))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        for begin in range(0, len(order), batch_size):
            yield [examples[i] for i in order[begin:begin + batch_size]]


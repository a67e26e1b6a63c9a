"""Prompt rows made ready for rollout: chat-formatted, tokenized, length-checked, and served in
seeded, shuffled batches epoch after epoch."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError
from ..tasks.arith import ArithTaskConfig, write_splits
from ..tasks.config import DataConfig
from ..tasks.dataset import read_rows


@dataclass(frozen=True, slots=True)
class Prompt:
    index: int  # row number in its split (0-based), the prompt's identity in the ledger
    prompt: str
    answer: str
    prompt_ids: tuple[int, ...]


@dataclass
class PromptSet:
    prompts: list[Prompt]
    truncated: int  # prompts cut to max_prompt_tokens (prompt_overflow=truncate)

    @classmethod
    def from_rows(cls, rows: list[dict], source: str, tokenizer, max_tokens: int,
                  overflow: str) -> "PromptSet":
        prompts, truncated = [], 0
        for index, row in enumerate(rows):
            messages = [{"role": "user", "content": row["prompt"]}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            if len(ids) > max_tokens:
                if overflow == "error":
                    raise ConfigError(f"{source}: row {index + 1}: prompt is {len(ids)} tokens, "
                                      f"more than data.max_prompt_tokens={max_tokens} (raise it, "
                                      "or set data.prompt_overflow=truncate)")
                ids, truncated = ids[-max_tokens:], truncated + 1  # keep the assistant header
            prompts.append(Prompt(index, row["prompt"], str(row["answer"]), tuple(ids)))
        if not prompts:
            raise ConfigError(f"{source}: no prompt rows")
        return cls(prompts, truncated)

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[int, list[Prompt]]]:
        """Endless (epoch, prompts) batches; each epoch is a new seeded permutation, so resume
        is reproducible. A last partial batch of an epoch is served too: every prompt of an
        epoch comes up exactly once."""
        epoch = 0
        while True:
            order = list(range(len(self.prompts)))
            random.Random(f"{seed}-{epoch}").shuffle(order)
            for start in range(0, len(order), batch_size):
                yield epoch, [self.prompts[i] for i in order[start:start + batch_size]]
            epoch += 1


def load_splits(config: DataConfig, data_dir: Path, seed: int) -> tuple[list[dict], list[dict],
                                                                       str, str]:
    """Train and eval rows with the file each came from; the built-in task is generated into
    `data_dir` (deterministic in `seed`) when no paths are configured."""
    if config.train_path is None:
        train_path, eval_path = write_splits(data_dir, seed, config.train_size, config.eval_size,
                                             ArithTaskConfig())
    else:
        train_path, eval_path = Path(config.train_path), Path(config.eval_path)
    rows = []
    for path in (train_path, eval_path):
        if not path.is_file():
            raise ConfigError(f"data file '{path}' does not exist")
        try:
            rows.append(read_rows(path))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return rows[0], rows[1], str(train_path), str(eval_path)

"""Prompt rows made ready for rollout: chat-formatted, tokenized, length-checked, and served in
seeded, shuffled batches epoch after epoch."""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError
from ..tasks.builtin import write_builtin_splits
from ..tasks.config import DataConfig
from ..tasks.dataset import read_rows
from ..tasks.formats import row_format
from ..token_bytes import max_token_bytes


@dataclass(frozen=True, slots=True)
class Prompt:
    index: int  # row number in its split (0-based), the prompt's identity in the ledger
    prompt: str  # chat-message prompts: their contents joined (prompt_text)
    answer: str
    prompt_ids: tuple[int, ...]


@dataclass
class PromptSet:
    prompts: list[Prompt]
    truncated: int  # prompts cut to max_prompt_tokens (prompt_overflow=truncate)

    @classmethod
    def from_rows(cls, rows: list[dict], source: str, tokenizer, max_tokens: int,
                  overflow: str) -> "PromptSet":
        texts, refused = [], None
        per_token = None  # the most bytes a token covers, read once a prompt may be long
        for index, row in enumerate(rows):
            prompt = row["prompt"]
            size = prompt_bytes(prompt)
            if size > max_tokens:  # a token covers at least a byte: only then can it be long
                if per_token is None:
                    per_token = max_token_bytes(tokenizer)
                # bytes: a prompt's text longer than this cannot fit in max_tokens tokens
                cap = max_tokens * per_token
                if size > cap:  # refused or cut without tokenizing all of it
                    if overflow == "error":
                        refused = ConfigError(
                            f"{source}: row {index + 1}: prompt is {size} bytes, more than "
                            f"data.max_prompt_tokens={max_tokens} tokens can hold ({cap} bytes: "
                            f"a token of this tokenizer covers at most {per_token} bytes); not "
                            "tokenized (raise data.max_prompt_tokens, or set "
                            "data.prompt_overflow=truncate)")
                        break  # the rows before it are still checked first, in order
                    # only its end is kept; twice the bytes the kept tokens can cover, so that
                    # the cut is far from them
                    prompt = prompt_tail(prompt, 2 * cap)
            texts.append(prompt)
        prompts, truncated = [], 0
        for index, (row, ids) in enumerate(zip(rows, prompts_ids(tokenizer, texts))):
            if len(ids) > max_tokens:
                if overflow == "error":
                    raise ConfigError(f"{source}: row {index + 1}: prompt is {len(ids)} tokens, "
                                      f"more than data.max_prompt_tokens={max_tokens} (raise it, "
                                      "or set data.prompt_overflow=truncate)")
                ids, truncated = ids[-max_tokens:], truncated + 1  # keep the assistant header
            prompts.append(Prompt(index, prompt_text(row["prompt"]), str(row["answer"]),
                                  tuple(ids)))
        if refused is not None:
            raise refused
        if not prompts:
            raise ConfigError(f"{source}: no prompt rows")
        return cls(prompts, truncated)

    def batches(self, batch_size: int, seed: int, start: tuple[int, int] = (0, 0)
                ) -> Iterator[tuple[int, list[Prompt]]]:
        """Endless (epoch, prompts) batches; each epoch is a new seeded permutation, so resume
        is reproducible: `start` = (epoch, prompts of its permutation already served) goes on
        from there. A last partial batch of an epoch is served too: every prompt of an epoch
        comes up exactly once."""
        epoch, first = start
        while True:
            order = list(range(len(self.prompts)))
            random.Random(f"{seed}-{epoch}").shuffle(order)
            for begin in range(first, len(order), batch_size):
                yield epoch, [self.prompts[i] for i in order[begin:begin + batch_size]]
            epoch, first = epoch + 1, 0

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the prompts and answers in order: a resume checks it is given the same
        data, since its position in the permutation means nothing for other data. Computed
        once: every checkpoint records it."""
        digest = hashlib.sha256()
        for p in self.prompts:
            digest.update(json.dumps([p.prompt, p.answer, list(p.prompt_ids)]).encode())
        return digest.hexdigest()


class PromptQueue:
    """The order prompts are drawn in: the seeded batches of `PromptSet.batches`, where they
    are in them, and the prompts drawn but not yet handed out. Its state is the data position
    a checkpoint keeps, so a resume draws exactly what the uninterrupted run would have."""

    def __init__(self, prompts: PromptSet, batch_size: int, seed: int) -> None:
        self.prompts, self.batch_size, self.seed = prompts, batch_size, seed
        self._position = (0, 0)  # (epoch, prompts of its permutation drawn)
        self._batches = prompts.batches(batch_size, seed)
        self._pending: deque[tuple[int, Prompt]] = deque()

    def take(self, count: int) -> list[tuple[int, Prompt]]:
        """The next `count` (epoch, prompt) pairs; drawn prompts are never skipped."""
        while len(self._pending) < count:
            epoch, prompts = next(self._batches)
            drawn = self._position[1] if epoch == self._position[0] else 0
            self._position = (epoch, drawn + len(prompts))
            self._pending.extend((epoch, prompt) for prompt in prompts)
        return [self._pending.popleft() for _ in range(count)]

    def state(self) -> dict:
        return {"epoch": self._position[0], "drawn": self._position[1],
                "pending": [[epoch, prompt.index] for epoch, prompt in self._pending]}

    def restore(self, state: dict) -> None:
        self._position = (state["epoch"], state["drawn"])
        self._batches = self.prompts.batches(self.batch_size, self.seed, self._position)
        self._pending = deque((epoch, self.prompts.prompts[index])
                              for epoch, index in state["pending"])


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt as one string: itself, or its chat messages' contents joined by blank lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(message["content"] for message in prompt)


def prompt_bytes(prompt: str | list[dict]) -> int:
    """UTF-8 bytes of a prompt's text (chat messages: their contents)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", errors="replace"))
    return sum(len(m["content"].encode("utf-8", errors="replace")) for m in prompt)


def prompt_tail(prompt: str | list[dict], budget: int) -> str | list[dict]:
    """The end of a prompt, at most `budget` bytes of text: a string's last bytes (cut at a
    character), or the last chat messages, the first of them cut to its end."""
    if isinstance(prompt, str):
        return prompt.encode("utf-8", errors="replace")[-budget:].decode("utf-8", errors="ignore")
    kept: list[dict] = []
    for message in reversed(prompt):
        size = len(message["content"].encode("utf-8", errors="replace"))
        if size <= budget:
            kept.append(message)
            budget -= size
            continue
        if budget > 0 or not kept:
            kept.append({**message, "content": prompt_tail(message["content"], budget)})
        break
    return kept[::-1]


def prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a prompt ready for generation. A string is one user turn; a list of chat
    messages is used as it is. With a chat template (`tokenizer.chat_template`) the messages
    are rendered by it, ending in the assistant header; without one, the messages' contents
    are joined by blank lines (`prompt_text`) and tokenized as plain text."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer(prompt_text(prompt))["input_ids"])


def prompts_ids(tokenizer, prompts: list[str | list[dict]]) -> list[list[int]]:
    """`prompt_ids` of many prompts: rendered one by one, tokenized as one batch (the fast
    tokenizer's batch encoding; rendering then encoding is what `apply_chat_template` does
    with `tokenize=True`). Measured on the default's 20,000 prompts: 1.2 s against 2.0 s."""
    if not prompts:
        return []
    if getattr(tokenizer, "chat_template", None):
        conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p
                         for p in prompts]
        texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True,
                                              tokenize=False)
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [list(ids) for ids in tokenizer([prompt_text(p) for p in prompts])["input_ids"]]


def load_splits(config: DataConfig, data_dir: Path, seed: int) -> tuple[list[dict], list[dict],
                                                                       str, str]:
    """Train and eval rows with the file each came from; the built-in task is generated into
    `data_dir` (deterministic in `seed`) when no paths are configured. Configured files are
    read in `config.format` with `config.fields` in place of its field names."""
    if config.train_path is None:
        train_path, eval_path = write_builtin_splits(config.task, data_dir, seed,
                                                     config.train_size, config.eval_size)
    else:
        train_path, eval_path = Path(config.train_path), Path(config.eval_path)
    fmt = row_format(config.format, config.fields.prompt, config.fields.answer)
    rows = []
    for key, path in (("train_path", train_path), ("eval_path", eval_path)):
        try:
            rows.append(read_rows(path, fmt))
        except ValueError as exc:
            raise ConfigError(f"data.{key}: {exc}") from None
        if not rows[-1]:
            raise ConfigError(f"data.{key}: data file '{path}' holds no rows")
    return rows[0], rows[1], str(train_path), str(eval_path)

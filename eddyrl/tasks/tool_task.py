"""The tiny multi-turn task: add a few numbers too long to add in one's head, with the calculator.

Same prompt and answer format as the arith task (`add 48213 90377`, answer `138590`), so the
same reward scores it, but with 4- to 6-digit operands: the ~1M-parameter tiny policy cannot
carry digits that far, while it can copy them. The intended episode, in the tiny tokenizer's
characters (`TINY_SYNTAX`), is two model turns around one tool call:

    model:  calc:48213+90377#        (stops on `#`)
    env:    result:138590\\n           (masked)
    model:  = 138590<|im_end|>       (scored: the number after the last `=`)

`demonstration` gives those segments for a supervised warm start; RL from there should raise
the share of episodes that call the tool and copy its result.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from .arith import format_prompt, in_eval_split, parse_prompt
from .arith import write_splits as write_task_splits
from ..envs.calculator import TINY_SYNTAX


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ToolTaskConfig:
    min_terms: int = 2
    max_terms: int = 3
    min_digits: int = 4
    max_digits: int = 6
    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.min_terms <= self.max_terms:
            raise ValueError(f"tool_task.min_terms={self.min_terms}, max_terms="
                             f"{self.max_terms}: need 1 <= min_terms <= max_terms")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"tool_task.min_digits={self.min_digits}, max_digits="
                             f"{self.max_digits}: need 1 <= min_digits <= max_digits")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"tool_task.eval_fraction={self.eval_fraction}: must be in (0, 1)")


def generate_rows(count: int, seed: int, split: str, config: ToolTaskConfig) -> list[dict]:
    """`count` rows `{"prompt", "answer", "num_terms"}` of `split` ("train" or "eval"),
    deterministic in `seed`; the splits are disjoint (by a hash of the prompt)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    rng = random.Random(f"tool-{seed}-{split}")
    rows: list[dict] = []
    while len(rows) < count:
        k = rng.randint(config.min_terms, config.max_terms)
        numbers = [_number(rng, rng.randint(config.min_digits, config.max_digits))
                   for _ in range(k)]
        prompt = format_prompt(numbers)
        if in_eval_split(prompt, config.eval_fraction) == (split == "eval"):
            rows.append({"prompt": prompt, "answer": str(sum(numbers)), "num_terms": k})
    return rows


def write_splits(out_dir: Path, seed: int, train_count: int, eval_count: int,
                 config: ToolTaskConfig) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` into `out_dir`; returns their paths."""
    return write_task_splits(out_dir, seed, train_count, eval_count, config,
                             generate=generate_rows)


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def demonstration(prompt: str) -> list[tuple[str, str]]:
    """The reference episode as (speaker, text) segments, speaker "model" or "env"."""
    numbers = parse_prompt(prompt)
    total = str(sum(numbers))
    call = TINY_SYNTAX.call_open + "+".join(map(str, numbers)) + TINY_SYNTAX.call_close
    return [("model", call), ("env", TINY_SYNTAX.result(total)), ("model", f"= {total}")]

"""Synthetic task "sum a list of numbers", written out as running partial sums.

Prompt `add 3 5 8`, response `3 8 16 = 16`. The number of terms k follows a truncated
Zipf law, so most responses are short and a few are long: the long tail that reasoning
traces have and that the runtime's scheduling must cope with.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from pathlib import Path

from eddyrl.tasks.dataset import write_rows

PROMPT_PREFIX = "add "


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ArithTaskConfig:
    """How hard the task is. The defaults are the ones the shipped warm start was trained on."""

    min_terms: int = 2
    max_terms: int = 12
    zipf_exponent: float = 1.2  # P(k) ~ (k - min_terms + 1) ** -zipf_exponent
    max_operand: int = 9  # operands are drawn uniformly from 0..max_operand
    eval_fraction: float = 0.1  # share of the prompt space reserved for the held-out split

    def __post_init__(self) -> None:
        if not 1 <= self.min_terms <= self.max_terms:
            raise ValueError(
                f"arith.min_terms={self.min_terms}, arith.max_terms={self.max_terms}: "
                "need 1 <= min_terms <= max_terms"
            )
        if self.max_operand < 1:
            raise ValueError(f"arith.max_operand={self.max_operand}: must be >= 1")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"arith.eval_fraction={self.eval_fraction}: must be in (0, 1)")


def term_count_weights(config: ArithTaskConfig) -> dict[int, float]:
    """Unnormalised probability of each term count k."""
    return {
        k: (k - config.min_terms + 1) ** -config.zipf_exponent
        for k in range(config.min_terms, config.max_terms + 1)
    }


def format_prompt(numbers: list[int]) -> str:
    return PROMPT_PREFIX + " ".join(str(n) for n in numbers)


def parse_prompt(prompt: str) -> list[int]:
    if not prompt.startswith(PROMPT_PREFIX):
        raise ValueError(f"not an arith prompt: {prompt!r}")
    return [int(token) for token in prompt[len(PROMPT_PREFIX) :].split()]


def demonstration(prompt: str) -> str:
    """The reference response: every running sum, then `= total`."""
    partial_sums, total = [], 0
    for number in parse_prompt(prompt):
        total += number
        partial_sums.append(str(total))
    return " ".join(partial_sums) + f" = {total}"


def max_response_chars(config: ArithTaskConfig) -> int:
    """Upper bound on a reference response's length, used to size max_new_tokens."""
    largest_sum_digits = len(str(config.max_terms * config.max_operand))
    return (largest_sum_digits + 1) * (config.max_terms + 1) + 2


def in_eval_split(prompt: str, eval_fraction: float) -> bool:
    """Whether `prompt` belongs to the held-out split (every built-in task splits this way)."""
    # Splitting by a stable hash of the prompt keeps train and eval disjoint whatever their
    # sizes, without skewing the term-count distribution of either.
    return zlib.crc32(prompt.encode()) % 10_000 < eval_fraction * 10_000


def generate_rows(count: int, seed: int, split: str, config: ArithTaskConfig) -> list[dict]:
    """`count` rows of the `split` ("train" or "eval"), deterministic in `seed`."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    rng = random.Random(f"{seed}-{split}")
    weights = term_count_weights(config)
    term_counts, term_weights = list(weights), list(weights.values())
    want_eval = split == "eval"
    rows: list[dict] = []
    while len(rows) < count:
        k = rng.choices(term_counts, term_weights)[0]
        numbers = [rng.randint(0, config.max_operand) for _ in range(k)]
        prompt = format_prompt(numbers)
        if in_eval_split(prompt, config.eval_fraction) != want_eval:
            continue
        rows.append({"prompt": prompt, "answer": str(sum(numbers)), "num_terms": k})
    return rows


def write_splits(
    out_dir: Path, seed: int, train_count: int, eval_count: int, config: ArithTaskConfig,
    generate=None,
) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` into `out_dir`; returns their paths. `generate`
    (default: this task's `generate_rows`) makes another task's rows the same way."""
    generate = generate or generate_rows
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    write_rows(train_path, generate(train_count, seed, "train", config))
    write_rows(eval_path, generate(eval_count, seed, "eval", config))
    return train_path, eval_path

"""Synthetic task "encipher a word": a fixed letter-substitution key, applied letter by letter.

Prompt `enc hello`, response `efnnx` (the answer is the enciphered word, scored by exact match).
The key is one fixed permutation of a..z (`KEY`), the same for every prompt, so the policy has
to learn 26 letter facts, one per letter; a word is right only if all its letters are. Words
are 5 to 12 letters long (a long tail of response lengths) with letters drawn by a gentle Zipf
law, so every letter turns up in most batches.

This is the built-in task with headroom (`data.task = cipher`, `eddy train cipher_tiny`): its
warm start (`eddyrl/assets/cipher_warmstart`) is an honest SFT cut short, which knows the common
letters and half-knows the rest, and RL raises its held-out accuracy letter by letter over
hundreds of steps instead of in one jump (see the asset's README for the measurements).
"""

from __future__ import annotations

import dataclasses
import random
import string
from pathlib import Path

from .arith import in_eval_split
from .arith import write_splits as write_task_splits

PROMPT_PREFIX = "enc "
ALPHABET = string.ascii_lowercase
# The substitution: ALPHABET[i] enciphers to KEY[i] (a -> t, b -> d, ...). Literal, so the task
# never depends on a random generator's implementation.
KEY = "tdszfhrembjnouxivcqlpwagyk"
_ENCIPHER = dict(zip(ALPHABET, KEY))
# The letters from most to least frequent (rank r has weight r ** -letter_zipf).
FREQUENCY_ORDER = "jaznbksuexgchdtfmyqiopvlwr"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CipherTaskConfig:
    """How the words are drawn. The defaults are the ones the shipped warm start was made on."""

    min_letters: int = 5
    max_letters: int = 12
    length_zipf: float = 0.5  # P(length n) ~ (n - min_letters + 1) ** -length_zipf
    letter_zipf: float = 1.0  # P(letter of rank r) ~ r ** -letter_zipf (FREQUENCY_ORDER)
    eval_fraction: float = 0.1  # share of the prompt space reserved for the held-out split

    def __post_init__(self) -> None:
        if not 1 <= self.min_letters <= self.max_letters:
            raise ValueError(
                f"cipher.min_letters={self.min_letters}, cipher.max_letters={self.max_letters}: "
                "need 1 <= min_letters <= max_letters"
            )
        if self.length_zipf < 0 or self.letter_zipf < 0:
            raise ValueError(f"cipher.length_zipf={self.length_zipf}, cipher.letter_zipf="
                             f"{self.letter_zipf}: must be >= 0")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"cipher.eval_fraction={self.eval_fraction}: must be in (0, 1)")


def encipher(word: str) -> str:
    """`word` (letters a..z) under the key."""
    try:
        return "".join(_ENCIPHER[letter] for letter in word)
    except KeyError as error:
        raise ValueError(f"not a lower-case word: {word!r}") from error


def format_prompt(word: str) -> str:
    return PROMPT_PREFIX + word


def parse_prompt(prompt: str) -> str:
    if not prompt.startswith(PROMPT_PREFIX):
        raise ValueError(f"not a cipher prompt: {prompt!r}")
    return prompt[len(PROMPT_PREFIX):]


def demonstration(prompt: str) -> str:
    """The reference response: the enciphered word."""
    return encipher(parse_prompt(prompt))


def max_response_chars(config: CipherTaskConfig) -> int:
    """The longest reference response, used to size max_new_tokens."""
    return config.max_letters


def reward(response_text: str, answer: str) -> float:
    """1.0 when the response is exactly the enciphered word (surrounding whitespace aside)."""
    return 1.0 if response_text.strip() == answer.strip() else 0.0


def generate_rows(count: int, seed: int, split: str, config: CipherTaskConfig) -> list[dict]:
    """`count` rows `{"prompt", "answer", "num_terms"}` (num_terms: the word's length) of the
    `split` ("train" or "eval"), deterministic in `seed`; the splits are disjoint (by a hash
    of the prompt, as arith's)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
    rng = random.Random(f"cipher-{seed}-{split}")
    letters = list(FREQUENCY_ORDER)
    letter_weights = [(rank + 1) ** -config.letter_zipf for rank in range(len(letters))]
    lengths = list(range(config.min_letters, config.max_letters + 1))
    length_weights = [(n - config.min_letters + 1) ** -config.length_zipf for n in lengths]
    want_eval = split == "eval"
    rows: list[dict] = []
    while len(rows) < count:
        length = rng.choices(lengths, length_weights)[0]
        word = "".join(rng.choices(letters, letter_weights, k=length))
        prompt = format_prompt(word)
        if in_eval_split(prompt, config.eval_fraction) != want_eval:
            continue
        rows.append({"prompt": prompt, "answer": encipher(word), "num_terms": length})
    return rows


def write_splits(out_dir: Path, seed: int, train_count: int, eval_count: int,
                 config: CipherTaskConfig) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` into `out_dir`; returns their paths."""
    return write_task_splits(out_dir, seed, train_count, eval_count, config,
                             generate=generate_rows)

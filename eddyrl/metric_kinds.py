"""How a trainer metric is put together from a step's parts, by its name: the one rule the
training engine (over micro-batches), the update (over optimizer steps) and the controller
(over a streamed step's training calls) follow.

- a maximum (`*_max`, `*_max_*`: `mismatch_max_abs`, `buddy_copy_s_max`): the largest;
- a total (`*_sum`, `*_tokens`, `*_s`: sums, token counts, seconds spent one part after the
  other; and `skipped_updates`, a count): added;
- anything else (a loss, a gradient norm, a fraction, a token mean) is a mean over the
  optimizer steps: averaged over the parts, which run the same number of optimizer steps each.
"""

from __future__ import annotations

from typing import Iterable

COUNTS = frozenset({"skipped_updates"})


def is_maximum(name: str) -> bool:
    """A metric that is a maximum: reduced with max, never averaged."""
    return name.endswith("_max") or "_max_" in name


def is_total(name: str) -> bool:
    """A metric whose parts add up: a sum, a token count, seconds, or a count."""
    return name in COUNTS or name.endswith(("_sum", "_tokens", "_s"))


def combine_parts(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """One metric dict from its parts' (each the same number of optimizer steps), by the rule
    above; a mean is over the parts that report it."""
    combined: dict[str, float] = {}
    seen: dict[str, int] = {}
    for part in parts:
        for name, value in part.items():
            seen[name] = seen.get(name, 0) + 1
            if name not in combined:
                combined[name] = value
            elif is_maximum(name):
                combined[name] = max(combined[name], value)
            else:
                combined[name] += value
    return {name: value if is_maximum(name) or is_total(name) else value / seen[name]
            for name, value in combined.items()}

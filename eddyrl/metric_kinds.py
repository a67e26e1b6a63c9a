"""How a trainer metric is put together from a step's parts, by its name: the one rule the
training engine (over micro-batches), the update (over optimizer steps) and the controller
(over a streamed step's training calls) follow.

- a maximum (`*_max`, `*_max_*`: `mismatch_max_abs`, `buddy_copy_s_max`): the largest;
- a total (`*_sum`, `*_tokens`, `*_s`: sums, token counts, seconds spent one part after the
  other; and `skipped_updates`, a count): added;
- anything else (a loss, a gradient norm, a fraction, a token mean) is a mean over the
  optimizer steps: averaged over the parts, which run the same number of optimizer steps each;
- a value that is not a number (the elastic pool's `replicas_lost`, a record by worker) is
  the last part's.
"""

from __future__ import annotations

from typing import Any, Iterable

COUNTS = frozenset({"skipped_updates"})


def is_maximum(name: str) -> bool:
    """A metric that is a maximum: reduced with max, never averaged."""
    return name.endswith("_max") or "_max_" in name


def is_total(name: str) -> bool:
    """A metric whose parts add up: a sum, a token count, seconds, or a count."""
    return name in COUNTS or name.endswith(("_sum", "_tokens", "_s"))


def combine_parts(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One metric dict from its parts' (each the same number of optimizer steps), by the rule
    above; a mean is over the parts that report it."""
    combined: dict[str, Any] = {}
    seen: dict[str, int] = {}
    for part in parts:
        for name, value in part.items():
            seen[name] = seen.get(name, 0) + 1
            if name not in combined or not _is_number(value):
                combined[name] = value
            elif is_maximum(name):
                combined[name] = max(combined[name], value)
            else:
                combined[name] += value
    return {name: value / seen[name] if _is_number(value) and not is_maximum(name)
            and not is_total(name) else value for name, value in combined.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

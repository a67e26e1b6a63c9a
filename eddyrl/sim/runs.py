"""`Runs`: a read-only sequence stored as (value, count) runs.

Simulated engines stand for responses of thousands of tokens each; a list per token (ids,
log-probs, versions) would cost the simulator more than the step it models. A response of one
policy version is one run of versions; a simulated response is one run of token ids. `Runs`
behaves like the list it stands for (len, index, slice, iterate, ==, +), so the controller,
rollout and ledger code that reads results needs no special case.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import accumulate, repeat
from typing import Any, Iterable, Iterator


class Runs(Sequence):
    __slots__ = ("_values", "_ends")

    def __init__(self, runs: Iterable[tuple[Any, int]] = ()) -> None:
        values: list[Any] = []
        counts: list[int] = []
        for value, count in runs:
            if count < 0:
                raise ValueError(f"a run of {value!r} cannot have {count} elements")
            if not count:
                continue
            if values and values[-1] == value:  # merge equal neighbours
                counts[-1] += count
            else:
                values.append(value)
                counts.append(count)
        self._values = values
        self._ends = list(accumulate(counts))

    @classmethod
    def of(cls, items: Iterable[Any]) -> "Runs":
        """From any sequence (a list, or Runs)."""
        if isinstance(items, Runs):
            return items
        return cls((item, 1) for item in items)

    def runs(self) -> list[tuple[Any, int]]:
        starts = [0, *self._ends[:-1]]
        return [(v, e - s) for v, s, e in zip(self._values, starts, self._ends)]

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self._slice(start, max(start, stop))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} elements")
        return self._values[bisect.bisect_right(self._ends, index)]

    def _slice(self, start: int, stop: int) -> "Runs":
        out, begin = [], 0
        for value, end in zip(self._values, self._ends):
            lo, hi = max(begin, start), min(end, stop)
            if lo < hi:
                out.append((value, hi - lo))
            begin = end
        return Runs(out)

    def __iter__(self) -> Iterator[Any]:
        for value, count in self.runs():
            yield from repeat(value, count)

    def __add__(self, other: Iterable[Any]) -> "Runs":
        return Runs([*self.runs(), *Runs.of(other).runs()])

    def __radd__(self, other: Iterable[Any]) -> "Runs":
        return Runs([*Runs.of(other).runs(), *self.runs()])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Runs):
            return self._values == other._values and self._ends == other._ends
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.runs()))

    def __repr__(self) -> str:
        return f"Runs({self.runs()!r})"

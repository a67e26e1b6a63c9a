"""The experience store: the rollout's data path, a columnar table of samples that producers
fill and consumers take out.

AsyncFlow's TransferQueue idea (its experience store) as a sans-IO object: no threads, no clock,
no Ray. Rows are samples with a global integer index; columns are named fields. In the rollout
two producers write each row: the generation stream writes "response" when a request's final
result arrives, the scorer writes "reward" when that response is scored (off the event loop:
scoring is user code), and a group is collected once every row has both. Which collected
groups form the next batch is the version window's decision (staleness <= K), not the
store's: the trainer takes exactly those groups out (`take_groups`), whole.

What the store no longer has, and why: per-consumer readiness queries and a token balancer
were only ever called by their tests — the scorer works per response as it finishes (finer
than a group's readiness), the window picks batches, and data-parallel ranks are balanced by
loss tokens on the built batch (`batching.split_for_ranks`), where masked environment tokens
are known. One data path, not two.

Values are opaque: the store never looks inside them. Rows of a GRPO group are reserved,
handed out and dropped together: advantages are relative to the group, so a consumer must
never see part of one. Row indices are never reused, so a late write to a dropped group fails
loudly instead of landing in someone else's sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any



@dataclass(frozen=True, slots=True)
class GroupRows:
    """One group as handed to a consumer: its rows and, per requested column, one value a row."""

    group_id: str
    rows: list[int]
    columns: dict[str, list[Any]]
    meta: dict[str, Any]


@dataclass(slots=True)
class _Group:
    rows: list[int]
    meta: dict[str, Any]
    filled: dict[str, int] = field(default_factory=dict)  # column -> rows that have it
    consumed_by: set[str] = field(default_factory=set)


class ExperienceStore:
    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}  # insertion-ordered: oldest group first
        self._group_of_row: dict[int, str] = {}
        self._cells: dict[int, dict[str, Any]] = {}  # row -> column -> value
        self._next_row = 0

    def add_group(self, group_id: str, size: int, meta: dict[str, Any] | None = None,
                  ) -> list[int]:
        """Reserve `size` rows (one per response of the group) and return their indices."""
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} is already in the store")
        if size < 1:
            raise ValueError(f"group {group_id!r}: size must be >= 1, got {size}")
        rows = list(range(self._next_row, self._next_row + size))
        self._next_row += size
        self._groups[group_id] = _Group(rows=rows, meta=dict(meta or {}))
        for row in rows:
            self._group_of_row[row] = group_id
            self._cells[row] = {}
        return rows

    def put(self, row: int, column: str, value: Any) -> None:
        """Write one value and mark `column` ready for `row`."""
        self.put_many([row], column, [value])

    def put_many(self, rows: Sequence[int], column: str, values: Sequence[Any]) -> None:
        """Write one value per row; checked as a whole first, so a bad row writes nothing."""
        if len(rows) != len(values):
            raise ValueError(f"column {column!r}: {len(rows)} rows but {len(values)} values")
        seen: set[int] = set()
        for row in rows:
            if row not in self._cells:
                raise ValueError(f"row {row}, column {column!r}: unknown row (never reserved, "
                                 "or its group was dropped)")
            if column in self._cells[row] or row in seen:
                raise ValueError(f"row {row}, column {column!r}: already written")
            seen.add(row)
        for row, value in zip(rows, values):
            self._cells[row][column] = value
            group = self._groups[self._group_of_row[row]]
            group.filled[column] = group.filled.get(column, 0) + 1

    def is_complete(self, group_id: str, columns: Iterable[str]) -> bool:
        """Whether every row of the group has every one of `columns`."""
        return _complete(self._group(group_id), tuple(columns))

    def take_groups(self, consumer: str, group_ids: Sequence[str], columns: Iterable[str],
                    ) -> list[GroupRows]:
        """Mark these groups consumed by `consumer` and return them, in the order given (a
        scheduler upstream chose them). All or nothing: an unknown, incomplete or already
        consumed group raises before anything is marked."""
        needed = tuple(columns)
        for group_id in group_ids:
            group = self._group(group_id)
            if consumer in group.consumed_by:
                raise ValueError(f"group {group_id!r} was already consumed by {consumer!r}")
            if not _complete(group, needed):
                raise ValueError(f"group {group_id!r} is not ready: columns {list(needed)} "
                                 f"filled {group.filled} of {len(group.rows)} rows")
        return [self._hand_out(consumer, group_id, needed) for group_id in group_ids]

    def _hand_out(self, consumer: str, group_id: str, columns: tuple[str, ...]) -> GroupRows:
        group = self._groups[group_id]
        group.consumed_by.add(consumer)
        values = {c: [self._cells[row][c] for row in group.rows] for c in columns}
        return GroupRows(group_id=group_id, rows=list(group.rows), columns=values,
                         meta=group.meta)

    def _group(self, group_id: str) -> _Group:
        try:
            return self._groups[group_id]
        except KeyError:
            raise ValueError(f"group {group_id!r} is not in the store") from None

    def drop(self, group_id: str) -> None:
        """Free a group's rows (after training, or on eviction)."""
        group = self._groups.pop(group_id, None)
        if group is None:
            raise ValueError(f"group {group_id!r} is not in the store")
        for row in group.rows:
            del self._group_of_row[row]
            del self._cells[row]

def _complete(group: _Group, columns: tuple[str, ...]) -> bool:
    size = len(group.rows)
    return all(group.filled.get(column, 0) == size for column in columns)

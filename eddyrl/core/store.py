"""The experience store: a columnar table of samples that producers fill and consumers drain.

AsyncFlow's TransferQueue idea (its experience store) as a sans-IO object: no threads, no clock,
no Ray. Rows are samples with a global integer index; columns are named fields ("response",
"reward", "logprobs", ...). A producer writing a column marks it ready for that row; a consumer
asks for the groups whose rows have every column it needs and that it has not consumed yet.
So reward scoring can start on the first finished rollouts, and the trainer on the first scored
groups, instead of every stage waiting for the whole batch.

Values are opaque: the store never looks inside them (except the token-count column handed to
`balance_by_tokens`). In the runtime they are small Python objects or Ray ObjectRefs to bulk
tensors, so only metadata moves through whoever owns the store. Calls are atomic because the
owner (one Ray actor, or one loop) serialises them; the store itself takes no lock.

Rows of a GRPO group are reserved, handed out and dropped together: advantages are relative to
the group, so a consumer must never see part of one. Row indices are never reused, so a late write
to a dropped group fails loudly instead of landing in someone else's sample.
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


@dataclass(frozen=True, slots=True)
class StoreStats:
    rows: int
    groups: int
    ready: dict[str, int]  # per consumer: groups it could take now (with its last columns)
    consumed: dict[str, int]  # per consumer: groups still held that it has taken


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
        # The columns each consumer last asked for, so `stats` can count what it could take.
        self._consumer_columns: dict[str, tuple[str, ...]] = {}

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

    def ready_groups(self, consumer: str, columns: Iterable[str]) -> list[str]:
        """Groups, oldest first, whose every row has every column and that `consumer` has not
        consumed."""
        needed = tuple(columns)
        self._consumer_columns[consumer] = needed
        return [group_id for group_id, group in self._groups.items()
                if consumer not in group.consumed_by and _complete(group, needed)]

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

    def take(self, consumer: str, columns: Iterable[str], max_groups: int, min_groups: int = 1,
             ) -> list[GroupRows] | None:
        """Mark up to `max_groups` ready groups consumed by `consumer` and return them, oldest
        first; None (and nothing consumed) if fewer than `min_groups` are ready."""
        if not 0 <= min_groups <= max_groups:
            raise ValueError(f"take: need 0 <= min_groups <= max_groups, got min_groups = "
                             f"{min_groups}, max_groups = {max_groups}")
        needed = tuple(columns)
        ready = self.ready_groups(consumer, needed)
        if len(ready) < min_groups:
            return None
        return [self._hand_out(consumer, group_id, needed) for group_id in ready[:max_groups]]

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

    def stats(self) -> StoreStats:
        ready = {consumer: len(self.ready_groups(consumer, columns))
                 for consumer, columns in list(self._consumer_columns.items())}
        consumed = {consumer: sum(consumer in g.consumed_by for g in self._groups.values())
                    for consumer in self._consumer_columns}
        return StoreStats(rows=len(self._cells), groups=len(self._groups), ready=ready,
                          consumed=consumed)

    def balance_by_tokens(self, groups: Sequence[GroupRows], token_column: str, parts: int,
                          ) -> list[list[int]]:
        """The rows of `groups` split into `parts` (data-parallel ranks) with about equal token
        counts, read from `token_column` (an int per row). Rows, not groups, are split: group
        advantages are computed before the split, so a group need not share a rank."""
        rows = [row for group in groups for row in group.rows]
        counts = []
        for row in rows:
            cells = self._cells.get(row)
            if cells is None or token_column not in cells:
                raise ValueError(f"row {row}, column {token_column!r}: no token count (row "
                                 "dropped, or the column not written yet)")
            counts.append(int(cells[token_column]))
        return [[rows[i] for i in part] for part in balanced_partition(counts, parts)]


def _complete(group: _Group, columns: tuple[str, ...]) -> bool:
    size = len(group.rows)
    return all(group.filled.get(column, 0) == size for column in columns)


def balanced_partition(token_counts: list[int], parts: int) -> list[list[int]]:
    """Row indices for each part, greedily balancing token counts (longest first), each part
    getting as close to the same number of rows as possible."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    capacity = -(-len(token_counts) // parts)  # rows per part, rounded up
    order = sorted(range(len(token_counts)), key=lambda i: -token_counts[i])
    bins: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in order:
        open_bins = [b for b in range(parts) if len(bins[b]) < capacity]
        target = min(open_bins, key=lambda b: loads[b])
        bins[target].append(i)
        loads[target] += token_counts[i]
    return [sorted(b) for b in bins]

"""Splitting rows into parts of about equal token counts (data-parallel ranks): sans-IO, so
that modules which must not load torch can use it."""

from __future__ import annotations


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

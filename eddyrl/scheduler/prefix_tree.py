"""What Libra's router knows about a request's future: states (a tool return summarised as
tool, payload size class and status; or a generated-length milestone for single-turn
generation) and prefix trees of states whose nodes keep the remaining output tokens observed
after reaching them, over a sliding window, with mean and P90 refreshed periodically. One tree
per prompt and a global one; `predict` takes the deepest trusted node. Used by `buckets.py`.

Sans-IO: no clock, no randomness.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable, NamedTuple, Sequence


@dataclass(frozen=True, slots=True)
class Milestone:
    """Single-turn generation passed milestones[index] generated tokens."""

    index: int


def milestone_state(generated_tokens: int, milestones: Sequence[int]) -> Milestone | None:
    """The last milestone `generated_tokens` has reached, or None before the first one (the
    request is still at the tree's root)."""
    passed = sum(generated_tokens >= m for m in milestones)
    return Milestone(passed - 1) if passed else None


State = Hashable  # a ToolState or a Milestone; any hashable summary works


# -- prefix trees ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NodeStats:
    mean: float
    p90: int
    count: int  # observations the statistics were computed from


class Prediction(NamedTuple):
    mean: float  # remaining output tokens
    p90: int
    source: str  # "prompt" or "global"
    depth: int  # states on the path to the node used (0: the root)


def p90(values: Sequence[int]) -> int:
    """Nearest-rank 90th percentile: an observed value, the smallest with >= 90% at or
    below it."""
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


class _Node:
    __slots__ = ("children", "window", "stats", "dirty")

    def __init__(self, window: int) -> None:
        self.children: dict[State, _Node] = {}
        self.window: deque[int] = deque(maxlen=window)
        self.stats: NodeStats | None = None  # as of the last rebuild
        self.dirty = False  # observed since the last rebuild


class PrefixTrees:
    """Remaining-length statistics keyed by paths of states: one tree per prompt, one global."""

    def __init__(self, window: int, rebuild_every: int, min_observations: int) -> None:
        self.window = window
        self.rebuild_every = rebuild_every
        self.min_observations = min_observations
        self.global_root = _Node(window)
        self.prompt_roots: dict[str, _Node] = {}
        self._since_rebuild = 0  # requests observed since the last rebuild

    def observe(self, prompt_id: str, path: Sequence[State],
                remaining_per_prefix: Sequence[int]) -> None:
        """Record one finished request: remaining_per_prefix[i] is the output it generated after
        reaching path[:i] (so [0] is its whole output, and there is one more than states)."""
        if len(remaining_per_prefix) != len(path) + 1:
            raise ValueError(f"{len(remaining_per_prefix)} remaining lengths for a path of "
                             f"{len(path)} states; give one per prefix, root included")
        if prompt_id not in self.prompt_roots:
            self.prompt_roots[prompt_id] = _Node(self.window)
        for root in (self.prompt_roots[prompt_id], self.global_root):
            node = root
            for depth, remaining in enumerate(remaining_per_prefix):
                if depth:
                    state = path[depth - 1]
                    if state not in node.children:
                        node.children[state] = _Node(self.window)
                    node = node.children[state]
                node.window.append(remaining)
                node.dirty = True
        self._since_rebuild += 1
        if self._since_rebuild >= self.rebuild_every:
            self.rebuild()

    def rebuild(self) -> None:
        """Refresh mean and P90 of every node observed since the last rebuild."""
        for root in (self.global_root, *self.prompt_roots.values()):
            stack = [root]
            while stack:
                node = stack.pop()
                if node.dirty:
                    values = node.window
                    node.stats = NodeStats(sum(values) / len(values), p90(values), len(values))
                    node.dirty = False
                stack.extend(node.children.values())
        self._since_rebuild = 0

    def predict(self, prompt_id: str, path: Sequence[State]) -> Prediction | None:
        """Statistics of the deepest trusted node on `path`; at equal depth the prompt's own tree
        wins over the global one. None when no node on the path is trusted yet."""
        best: Prediction | None = None
        for source, root in (("prompt", self.prompt_roots.get(prompt_id)),
                             ("global", self.global_root)):
            found = self._deepest_trusted(root, path)
            if found and (best is None or found[0] > best.depth):
                depth, stats = found
                best = Prediction(stats.mean, stats.p90, source, depth)
        return best

    def _deepest_trusted(self, root: _Node | None, path: Sequence[State]
                         ) -> tuple[int, NodeStats] | None:
        found = None
        node = root
        for depth in range(len(path) + 1):
            if node is None:
                break
            if node.stats is not None and node.stats.count >= self.min_observations:
                found = (depth, node.stats)
            node = node.children.get(path[depth]) if depth < len(path) else None
        return found


# -- the router --------------------------------------------------------------------------------

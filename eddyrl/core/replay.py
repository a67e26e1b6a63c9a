"""ReFlow's replay cycle: after its one fresh use, a group may be trained again, a bounded number
of times, while its policy lag stays small, with a reduced loss weight.

A training batch of B groups takes B - r fresh groups and r <= floor(σ·B) replayed ones, each
replayed group weighted τ in the loss. A group whose lag (trainer version - behaviour version)
exceeds δ is evicted, never trained; so is one replayed `max_reuse` times. Selection prefers
informative groups (rewards not all equal: GRPO learns nothing from the others), then the most
recent behaviour version (the smallest importance-ratio correction), then FIFO. The fresh cycle
(exactly once per group) is the controller's job and the ledger's proof; this buffer only
decides replays.

Sans-IO and deterministic: no clock, no randomness; ties fall back to insertion order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..protocol import Group
from ..validation import check_range, contradiction


@dataclass(kw_only=True, slots=True)
class ReplayConfig:
    max_fraction: float = 0.0  # σ: largest replayed fraction of a batch; 0 = replay off
    loss_weight: float = 0.5  # τ: loss weight of replayed trajectories relative to fresh ones
    max_lag: int = 2  # δ: largest trainer - behaviour version a replayed group may have
    max_reuse: int = 2  # replays per group before it is evicted
    capacity: int = 256  # groups kept; the oldest is evicted when full

    @property
    def enabled(self) -> bool:
        return self.max_fraction > 0

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.max_fraction", self.max_fraction, 0, 1)
        check_range(f"{prefix}.loss_weight", self.loss_weight, 0, 1)
        check_range(f"{prefix}.max_lag", self.max_lag, 0)
        check_range(f"{prefix}.max_reuse", self.max_reuse, 1)
        check_range(f"{prefix}.capacity", self.capacity, 1)
        if self.enabled and self.loss_weight == 0:
            raise contradiction(
                f"{prefix}.max_fraction = {self.max_fraction} replays groups but "
                f"{prefix}.loss_weight = 0 gives them no gradient; they would only take batch "
                f"slots from fresh data. Set loss_weight in (0, 1] or max_fraction = 0")
        if self.enabled and self.max_lag == 0:
            # A group is replayed only after its fresh step, so the trainer is >= 1 version
            # past the policy that generated it: with δ = 0 every replay is evicted.
            raise contradiction(
                f"{prefix}.max_fraction = {self.max_fraction} with {prefix}.max_lag = 0: a "
                f"replayed group is always at least 1 version old, so nothing could be "
                f"replayed. Set max_lag >= 1 or max_fraction = 0")


@dataclass(slots=True)
class _Entry:
    group: Group
    behaviour_version: int
    informative: bool
    order: int  # insertion order: the FIFO tie-break
    reuses: int = 0


class ReplayBuffer:
    def __init__(self, config: ReplayConfig) -> None:
        self.config = config
        self._entries: dict[str, _Entry] = {}
        self._added = 0
        self._selected_total = 0
        self._evicted = {"lag": 0, "reuse": 0, "capacity": 0}
        self._evicted_log: list[tuple[str, str]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._entries

    def add(self, group: Group, behaviour_version: int, informative: bool) -> bool:
        """Keep a group after its fresh use. Returns False (keeps nothing) when replay is off,
        so the caller can end the group's life (`Ledger.finish`). When full, the oldest group
        (lowest behaviour version, then first added) is evicted: it is closest to the lag
        bound, so the least replay is lost."""
        if not self.config.enabled:
            return False
        group_id = group.group_id
        if group_id in self._entries:
            raise ValueError(f"group {group_id!r} is already in the replay buffer")
        if len(self._entries) >= self.config.capacity:
            oldest = min(self._entries.values(), key=lambda e: (e.behaviour_version, e.order))
            self._evict(oldest.group.group_id, "capacity")
        self._entries[group_id] = _Entry(group, behaviour_version, informative, self._added)
        self._added += 1
        return True

    def replay_slots(self, batch_groups: int) -> int:
        """floor(σ·B), rounded first so that e.g. 0.29 * 100 = 28.999... still gives 29."""
        return math.floor(round(self.config.max_fraction * batch_groups, 9))

    def fresh_slots(self, batch_groups: int) -> int:
        """Fresh groups in a batch of `batch_groups`: the rest (ReFlow: (1 - σ)·B)."""
        return batch_groups - self.replay_slots(batch_groups)

    def select(self, batch_groups: int, trainer_version: int) -> list[tuple[Group, float]]:
        """Groups to replay in a batch of `batch_groups`, each with its loss weight τ. A group
        returned for its last allowed reuse is also evicted ("reuse"): record the replays in
        the ledger before the evictions from `evicted_since_last`."""
        for entry in list(self._entries.values()):
            if trainer_version - entry.behaviour_version > self.config.max_lag:
                self._evict(entry.group.group_id, "lag")
        ranked = sorted(self._entries.values(),
                        key=lambda e: (not e.informative, -e.behaviour_version, e.order))
        chosen = ranked[:self.replay_slots(batch_groups)]
        for entry in chosen:
            entry.reuses += 1
            if entry.reuses >= self.config.max_reuse:
                self._evict(entry.group.group_id, "reuse")
        self._selected_total += len(chosen)
        return [(entry.group, self.config.loss_weight) for entry in chosen]

    def evicted_since_last(self) -> list[tuple[str, str]]:
        """(group_id, reason) of every eviction since the last call, in order, so the
        controller can record them in the ledger. Reasons: "lag", "reuse", "capacity"."""
        log, self._evicted_log = self._evicted_log, []
        return log

    def stats(self) -> dict[str, int]:
        return {"size": len(self._entries), "added_total": self._added,
                "selected_total": self._selected_total,
                **{f"evicted_{reason}": n for reason, n in self._evicted.items()}}

    def state(self) -> dict[str, Any]:
        """Everything a resume needs, groups included as they are (`core/run_state.py` writes
        them to disk), entries in insertion order."""
        return {"entries": [{"group": e.group, "behaviour_version": e.behaviour_version,
                             "informative": e.informative, "order": e.order, "reuses": e.reuses}
                            for e in self._entries.values()],
                "added": self._added, "selected_total": self._selected_total,
                "evicted": dict(self._evicted), "evicted_log": list(self._evicted_log)}

    def restore(self, state: dict[str, Any]) -> None:
        self._entries = {e["group"].group_id: _Entry(e["group"], e["behaviour_version"],
                                                     e["informative"], e["order"], e["reuses"])
                         for e in state["entries"]}
        self._added, self._selected_total = state["added"], state["selected_total"]
        self._evicted = dict(state["evicted"])
        self._evicted_log = [tuple(item) for item in state["evicted_log"]]

    def _evict(self, group_id: str, reason: str) -> None:
        del self._entries[group_id]
        self._evicted[reason] += 1
        self._evicted_log.append((group_id, reason))

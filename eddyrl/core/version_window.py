"""Bounded-staleness admission for rollout: how many more prompt groups may be dispatched now, so
that no group is trained more than K policy versions after the one that generated it.

The rule is AReaL's, also Libra's admission control and DORA's constraint C3:

    capacity = min(max_concurrent - running, (K + version + 1) * B - (accepted + running))

Read it as slots. While the trainer is at version v, at most (K + v + 1)·B dispatches may have
been issued in all. If the trainer takes its batches in dispatch order (batch t is the t-th run
of B dispatched groups; `take_batch` does exactly this), a group dispatched at version d holds a
slot below (K + d + 1)·B, so it lands in a batch t <= K + d and is trained at most K versions
late. Taking batches in collection order instead is NOT covered by the formula: a slow group can
be overtaken by later ones until it is K + 1 versions old. `advance` refuses to strand a running
group like that, and `check_trainable` catches the rest.

K = 0 is synchronous on-policy training: step t's batch is generated entirely at version t.
K >= 1 is asynchronous / multi-version rollout. A mode is a value of K, not a code path.

A worker failure hands its group back (`requeue`): the slot is freed and the group is dispatched
again later, at the then-current version, so the bound still holds.

Sans-IO: no clock, no threads. Every answer is a function of the calls made so far, so the
runtime and the simulator can drive the same object.
"""

from __future__ import annotations

from collections import Counter

from ..validation import check_range


class VersionWindowError(RuntimeError):
    """A call the window cannot honour: the caller broke the dispatch/collect protocol."""


class StalenessError(VersionWindowError):
    """Training a group (or advancing) would break the staleness bound K (DORA's C3)."""


class VersionWindow:
    def __init__(self, max_staleness: int, batch_groups: int, max_concurrent: int) -> None:
        check_range("max_staleness", max_staleness, 0)
        check_range("batch_groups", batch_groups, 1)
        check_range("max_concurrent", max_concurrent, 1)
        self.max_staleness = max_staleness
        self.batch_groups = batch_groups
        self.max_concurrent = max_concurrent
        self.version = 0  # the trainer's current policy version
        self.accepted = 0  # groups collected, ever (a consumed slot stays consumed)
        # group -> dispatch version, in dispatch order, from dispatch until taken for training
        # (or requeued). Dict order is the slot order `take_batch` relies on.
        self._dispatch_version: dict[str, int] = {}
        self._running: set[str] = set()
        self._running_per_version: Counter[int] = Counter()

    # -- queries -------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Groups dispatched and not yet collected (or requeued)."""
        return len(self._running)

    def capacity(self) -> int:
        """How many more groups may be dispatched now."""
        k, b = self.max_staleness, self.batch_groups
        by_staleness = (k + self.version + 1) * b - (self.accepted + self.running)
        return max(0, min(self.max_concurrent - self.running, by_staleness))

    def running_groups(self) -> list[str]:
        """Groups now generating, in dispatch order."""
        return [g for g in self._dispatch_version if g in self._running]

    def is_running(self, group_id: str) -> bool:
        return group_id in self._running

    def dispatch_version(self, group_id: str) -> int:
        return self._record(group_id)

    def staleness(self, group_id: str) -> int:
        """Versions between the policy that generated the group and the trainer's current one."""
        return self.version - self._record(group_id)

    def live_versions(self) -> set[int]:
        """Versions some rollout must still host: those of running groups, plus the current one.
        At most K + 1 consecutive versions (`advance` keeps it so)."""
        return set(self._running_per_version) | {self.version}

    def retirable(self, version: int) -> bool:
        """Whether weights of `version` may be dropped from rollout: older than the current
        version and no running group generates with it."""
        return version < self.version and version not in self._running_per_version

    def check_trainable(self, dispatch_version: int) -> None:
        """Raise if a group generated at `dispatch_version` is too stale to train now (C3)."""
        lag = self.version - dispatch_version
        if lag > self.max_staleness:
            raise StalenessError(f"a group from version {dispatch_version} is {lag} versions "
                                 f"behind trainer version {self.version}; the bound is "
                                 f"max_staleness = {self.max_staleness}")

    def can_advance(self) -> bool:
        """Whether the next version keeps every running group within K of the trainer."""
        if not self._running_per_version:
            return True
        return self.version + 1 - min(self._running_per_version) <= self.max_staleness

    # -- protocol ------------------------------------------------------------------------------

    def dispatch(self, group_id: str) -> int:
        """Admit a group for rollout; returns the version it must be generated with (C1: one
        version per trajectory, so this tag never changes while it runs)."""
        if group_id in self._dispatch_version:
            raise VersionWindowError(f"group {group_id!r} is already dispatched")
        if self.capacity() == 0:
            raise VersionWindowError(
                f"no capacity to dispatch group {group_id!r}: running {self.running}/"
                f"{self.max_concurrent}, accepted {self.accepted}, version {self.version}, "
                f"max_staleness {self.max_staleness}, batch_groups {self.batch_groups}")
        self._dispatch_version[group_id] = self.version
        self._running.add(group_id)
        self._running_per_version[self.version] += 1
        return self.version

    def collect(self, group_id: str) -> None:
        """The group's rollout finished; its slot now counts as accepted."""
        self._stop_running(group_id, "collect")
        self.accepted += 1

    def requeue(self, group_id: str) -> None:
        """Its worker died: forget the dispatch so the group can be dispatched again (then at
        the current version: a partial rollout on old weights is not kept, C1)."""
        self._stop_running(group_id, "requeue")
        del self._dispatch_version[group_id]

    def take_batch(self) -> list[str] | None:
        """The next training batch in dispatch order: the B earliest-dispatched groups not yet
        taken, once all of them are collected; None while any of them still runs. This is the
        order under which the capacity formula proves staleness <= K."""
        head = list(self._dispatch_version)[:self.batch_groups]
        if len(head) < self.batch_groups or any(g in self._running for g in head):
            return None
        for group_id in head:
            self.check_trainable(self._dispatch_version.pop(group_id))
        return head

    def advance(self) -> int:
        """The trainer finished a step: the policy version moves on. Refuses while a running
        group would fall more than K versions behind (DORA slides its window only once the
        oldest version is fully collected): wait for it, or requeue it."""
        if not self.can_advance():
            oldest = min(self._running_per_version)
            raise StalenessError(
                f"cannot advance to version {self.version + 1}: "
                f"{self._running_per_version[oldest]} running group(s) from version {oldest} "
                f"would exceed max_staleness = {self.max_staleness}; collect or requeue them")
        self.version += 1
        return self.version

    # -- internals -----------------------------------------------------------------------------

    def _record(self, group_id: str) -> int:
        try:
            return self._dispatch_version[group_id]
        except KeyError:
            raise VersionWindowError(f"group {group_id!r} is not dispatched (or already "
                                     f"taken for training)") from None

    def _stop_running(self, group_id: str, verb: str) -> None:
        if group_id not in self._running:
            raise VersionWindowError(f"cannot {verb} group {group_id!r}: it is not running")
        self._running.remove(group_id)
        version = self._dispatch_version[group_id]
        self._running_per_version[version] -= 1
        if not self._running_per_version[version]:
            del self._running_per_version[version]

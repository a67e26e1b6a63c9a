"""Bounded-staleness admission for rollout: how many more prompt groups may be dispatched now, so
that no group is trained more than K policy versions after the one that generated it.

Every group dispatched at version d has a deadline d + K: the last trainer step that may use it.
The trainer takes exactly B groups per step. The window keeps the schedule feasible: for every
future step s, the groups not yet trained that are due by s fit in the steps left: at most
(s - version + 1)·B of them. For a new group at the current version v (deadline v + K) this is
AReaL's rule, also Libra's admission control and DORA's constraint C3 (the trainer has taken
v·B groups, so accepted + running - v·B are untaken):

    capacity = min(max_concurrent - running, (K + version + 1) * B - (accepted + running))

`capacity(d)` answers the same question for a group dispatched at an older version d still
hosted by some worker (DORA fills idle slots of legacy-version workers): its deadline is earlier,
so the bound is checked at every step from d + K on.

Training takes groups in completion order, not dispatch order: `take_batch` hands out the B
collected groups with the earliest deadlines (or, for a streamed step, `take_batch(count)` any
part of the B still untaken at this version: the rule below counts what the version has
taken), but only if what stays behind (running or not) can still be trained in time, i.e. at
most j·B groups with deadline <= version + j, for j = 0..K
(earliest-deadline-first is optimal for unit-size jobs, so it never refuses a batch that some
other choice would allow). A slow trajectory therefore does not hold up a batch of fast ones
until its own deadline comes; then the trainer waits for it (DORA slides its window only once the
oldest version is fully collected). With K = 0 a batch is everything dispatched at the current
version, as in synchronous training.

K = 0 is synchronous on-policy training: step t's batch is generated entirely at version t.
K >= 1 is asynchronous / multi-version rollout. A mode is a value of K, not a code path.

A worker failure hands its group back (`requeue`): the slot is freed and the group is dispatched
again later, at the then-current version, so the bound still holds.

K may change while the run goes (`set_max_staleness`: the stability governor, core/governor.py).
A group keeps the deadline it was dispatched with, so lowering K drops, repeats or strands
nothing already admitted: those groups are trained by their own deadline, as before, and only new
admissions get the new bound. Every rule above is therefore written over deadlines, not over
dispatch version + K (with a fixed K the two are the same); the feasibility checks run up to the
latest deadline of any untaken group.

How much may be in flight is bounded in one of the ways the published systems define it:

- K (`max_staleness`) bounds the versions between a group's dispatch and its training (DORA's
  constraint C3). The deadline rule above is AReaL's `max_head_offpolicyness` = K: its staleness
  manager admits while (K + version + 1)·B > accepted + running (areal/core/staleness_manager.py).
- `max_concurrent` bounds the groups generating at once (DORA's rollout batch size, AReaL's
  `max_concurrent_rollouts`): a group stops counting once collected.
- `max_started_per_sync` is verl's: its fully asynchronous rollouter starts at most
  (1 + staleness_threshold)·B samples per parameter sync, and a sync resets the count to the
  samples still in flight, running, interrupted or finished but not yet trained
  (recipe/fully_async_policy/fully_async_rollouter.py, `staleness_samples`); here a sync is a
  version. 0 leaves it out.
The three apply together (the least room wins); a system is reproduced by setting the ones it has.

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
    def __init__(self, max_staleness: int, batch_groups: int, max_concurrent: int,
                 max_started_per_sync: int = 0) -> None:
        check_range("max_staleness", max_staleness, 0)
        check_range("batch_groups", batch_groups, 1)
        check_range("max_concurrent", max_concurrent, 1)
        check_range("max_started_per_sync", max_started_per_sync, 0)
        self.max_staleness = max_staleness
        self.batch_groups = batch_groups
        self.max_concurrent = max_concurrent
        self.max_started_per_sync = max_started_per_sync  # 0: no such bound
        # groups counted against this version's start budget: those still in flight when it
        # began (running, or collected and not yet taken) and those dispatched since
        self.started_this_sync = 0
        self.version = 0  # the trainer's current policy version
        self.accepted = 0  # groups collected, ever (a consumed slot stays consumed)
        self.taken = 0  # groups of this version's batch handed out so far (0..B, until advance)
        # group -> dispatch version, in dispatch order, from dispatch until taken for training
        # (or requeued); and its deadline: the last trainer version that may train it
        # (dispatch version + the K in force at its dispatch)
        self._dispatch_version: dict[str, int] = {}
        self._deadline: dict[str, int] = {}
        # of those, per deadline: what capacity and take_batch count (kept, not recounted, as
        # they are asked at every dispatch and collected group)
        self._untaken_per_deadline: Counter[int] = Counter()
        self._running: set[str] = set()
        self._running_per_version: Counter[int] = Counter()  # which weights rollout still needs
        self._running_per_deadline: Counter[int] = Counter()

    # -- queries -------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Groups dispatched and not yet collected (or requeued)."""
        return len(self._running)

    def capacity(self, version: int | None = None) -> int:
        """How many more groups may be dispatched now to generate with `version` (default: the
        current one). Older versions are admitted only while their deadline is still ahead of
        the trainer and the schedule stays feasible."""
        b = self.batch_groups
        version = self.version if version is None else version
        new_deadline = version + self.max_staleness
        if version > self.version or (version < self.version and new_deadline <= self.version):
            return 0  # a future version, or one whose groups would be due at this very step
        # Each step from now to `deadline` trains B groups: those due by then must fit (the
        # current step counts only what it has not yet taken). The room is least at the new
        # group's deadline or at a later deadline already held (in between, it only grows).
        by_deadline = min((deadline - self.version + 1) * b - self.taken
                          - self._untaken_due_by(deadline)
                          for deadline in {new_deadline, *(d for d in self._untaken_per_deadline
                                                           if d > new_deadline)})
        room = min(self.max_concurrent - self.running, by_deadline)
        if self.max_started_per_sync:
            room = min(room, self.max_started_per_sync - self.started_this_sync)
        return max(0, room)

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

    def deadline(self, group_id: str) -> int:
        """The last trainer version that may train the group (fixed at its dispatch)."""
        self._record(group_id)
        return self._deadline[group_id]

    def live_versions(self) -> set[int]:
        """Versions some rollout must still host: those of running groups, plus the current one.
        At most K + 1 consecutive versions, K the largest in force while they were dispatched
        (`advance` keeps it so)."""
        return set(self._running_per_version) | {self.version}

    def retirable(self, version: int) -> bool:
        """Whether weights of `version` may be dropped from rollout: older than the current
        version and no running group generates with it."""
        return version < self.version and version not in self._running_per_version

    def check_trainable(self, group_id: str) -> None:
        """Raise if the group is too stale to train now: past its deadline (C3)."""
        self._check_deadline(self._record(group_id), self._deadline[group_id])

    def can_advance(self) -> bool:
        """Whether the next version keeps every running group within its deadline (its K)."""
        return not self._running_per_deadline or \
            self.version + 1 <= min(self._running_per_deadline)

    def set_max_staleness(self, k: int) -> None:
        """K for groups dispatched from now on. Groups already dispatched keep their deadlines:
        lowering K drops, repeats or strands none of them (module docstring)."""
        check_range("max_staleness", k, 0)
        self.max_staleness = k

    # -- protocol ------------------------------------------------------------------------------

    def dispatch(self, group_id: str, version: int | None = None) -> int:
        """Admit a group for rollout at `version` (default: the current one); returns the
        version it must be generated with (C1: one version per trajectory, so this tag never
        changes while it runs)."""
        version = self.version if version is None else version
        if group_id in self._dispatch_version:
            raise VersionWindowError(f"group {group_id!r} is already dispatched")
        if self.capacity(version) == 0:
            raise VersionWindowError(
                f"no capacity to dispatch group {group_id!r} at version {version}: running "
                f"{self.running}/{self.max_concurrent}, accepted {self.accepted}, trainer "
                f"version {self.version}, max_staleness {self.max_staleness}, batch_groups "
                f"{self.batch_groups}, started this sync {self.started_this_sync}/"
                f"{self.max_started_per_sync or 'unbounded'}")
        deadline = version + self.max_staleness
        self._dispatch_version[group_id] = version
        self._deadline[group_id] = deadline
        self._untaken_per_deadline[deadline] += 1
        self._running.add(group_id)
        self._running_per_version[version] += 1
        self._running_per_deadline[deadline] += 1
        self.started_this_sync += 1
        return version

    def collect(self, group_id: str) -> None:
        """The group's rollout finished; its slot now counts as accepted."""
        self._stop_running(group_id, "collect")
        self.accepted += 1

    def requeue(self, group_id: str) -> None:
        """Its worker died: forget the dispatch so the group can be dispatched again (then at
        the current version: a partial rollout on old weights is not kept, C1)."""
        self._stop_running(group_id, "requeue")
        self._forget(group_id)
        # its start is given back: dispatching it again counts it again
        self.started_this_sync = max(0, self.started_this_sync - 1)

    def take_batch(self, count: int | None = None) -> list[str] | None:
        """The next training batch: the `count` (default B) collected groups with the earliest
        deadlines (then dispatch order), or None while fewer are collected or while taking
        them would leave a group (running or not) unable to make its deadline. A streamed
        step takes its B in parts (`count` < B), each counted against what the version has
        left to take."""
        b = self.batch_groups
        count = b if count is None else count
        if count < 1:
            raise VersionWindowError(f"cannot take {count} group(s) for training")
        room = max(0, b - self.taken)  # of this version's B, not yet taken
        # collected = dispatched, not running (every running group is dispatched): counted
        # before listing them, as this is asked at every collected group
        if len(self._dispatch_version) - len(self._running) < count:
            return None
        # the part is the collected groups due first: what each deadline gives to it, and
        # what it leaves behind, follow from the counts per deadline (groups are listed only
        # once the part may be taken)
        left = Counter(self._untaken_per_deadline)  # deadline -> groups left behind
        need = count
        for deadline in sorted(left):
            chosen = min(need, left[deadline] - self._running_per_deadline[deadline])
            left[deadline] -= chosen
            need -= chosen
        due = 0
        for deadline in sorted(left):  # left behind and due by step `deadline`: the rest of
            due += left[deadline]      # this version, then deadline - version steps, take them
            if due > (deadline - self.version) * b + max(0, room - count):
                return None
        collected = [g for g in self._dispatch_version if g not in self._running]
        collected.sort(key=self._deadline.__getitem__)  # stable: dispatch order within
        batch = collected[:count]
        for group_id in batch:
            self._check_deadline(*self._forget(group_id))
        self.taken = min(b, self.taken + count)
        return batch

    def advance(self) -> int:
        """The trainer finished a step: the policy version moves on. Refuses while a running
        group would fall more than K versions behind: wait for it, or requeue it."""
        if not self.can_advance():
            due = min(self._running_per_deadline)
            versions = sorted({self._dispatch_version[g] for g in self._running
                               if self._deadline[g] == due})
            raise StalenessError(
                f"cannot advance to version {self.version + 1}: "
                f"{self._running_per_deadline[due]} running group(s) from version "
                f"{', '.join(map(str, versions))} must be trained by version {due} "
                f"(max_staleness = {due - versions[0]} at their dispatch); collect or requeue "
                "them")
        self.version += 1
        self.taken = 0
        # verl's reset at a parameter sync: what is still in flight counts against the new
        # version's budget (dispatched and not yet taken: running, or collected)
        self.started_this_sync = len(self._dispatch_version)
        return self.version

    # -- checkpoints ---------------------------------------------------------------------------

    def state(self) -> dict[str, int]:
        """What a resume keeps: the version and the groups accepted for training. Groups still
        dispatched (running, or collected and not yet taken) are not kept: a resume generates
        them again, and they are accepted then."""
        untaken = len(self._dispatch_version) - len(self._running)
        return {"version": self.version, "accepted": self.accepted - untaken}

    def restore(self, state: dict[str, int]) -> None:
        """Back to `state` at a step boundary, with nothing dispatched."""
        if self._dispatch_version:
            raise VersionWindowError(f"cannot restore a window with {len(self._dispatch_version)} "
                                     "group(s) dispatched")
        self.version, self.accepted, self.taken = state["version"], state["accepted"], 0
        self.started_this_sync = 0

    # -- internals -----------------------------------------------------------------------------

    def _untaken_due_by(self, deadline: int) -> int:
        """Groups dispatched and not yet taken (running or collected) due by step `deadline`."""
        return sum(n for d, n in self._untaken_per_deadline.items() if d <= deadline)

    def _check_deadline(self, dispatch_version: int, deadline: int) -> None:
        """C3: training now must not be past the group's deadline."""
        if self.version > deadline:
            raise StalenessError(f"a group from version {dispatch_version} is "
                                 f"{self.version - dispatch_version} versions behind trainer "
                                 f"version {self.version}; the bound is max_staleness = "
                                 f"{deadline - dispatch_version} (at its dispatch)")

    def _forget(self, group_id: str) -> tuple[int, int]:
        """The group is no longer dispatched (taken for training, or requeued): its version
        and deadline."""
        version = self._dispatch_version.pop(group_id)
        deadline = self._deadline.pop(group_id)
        _decrement(self._untaken_per_deadline, deadline)
        return version, deadline

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
        _decrement(self._running_per_version, self._dispatch_version[group_id])
        _decrement(self._running_per_deadline, self._deadline[group_id])


def _decrement(counts: Counter[int], key: int) -> None:
    """One fewer under `key`; an empty key is dropped (its presence is what min() reads)."""
    counts[key] -= 1
    if not counts[key]:
        del counts[key]

"""The version window keeps its untaken groups counted per deadline (for speed: the
simulator asks for capacity and a batch at every dispatch and collected group). These tests
check the counts against a window that recounts everything from its records at each question,
as the window did before: same capacity at every version, same batch or refusal, through
random dispatches (current and legacy versions), collects, requeues and takes."""

import random
from collections import Counter

import pytest

from eddyrl.core.version_window import VersionWindow


class RecountingWindow(VersionWindow):
    """The reference: capacity, `_untaken_due_by` and `take_batch` recount the groups from their
    deadlines every time, checking every step up to the latest deadline."""

    def _untaken_due_by(self, deadline: int) -> int:
        return sum(1 for d in self._deadline.values() if d <= deadline)

    def capacity(self, version: int | None = None) -> int:
        version = self.version if version is None else version
        new_deadline = version + self.max_staleness
        if version > self.version or (version < self.version and new_deadline <= self.version):
            return 0
        last = max([new_deadline, *self._deadline.values()])
        by_deadline = min((d - self.version + 1) * self.batch_groups - self.taken
                          - self._untaken_due_by(d) for d in range(new_deadline, last + 1))
        return max(0, min(self.max_concurrent - self.running, by_deadline))

    def take_batch(self, count: int | None = None) -> list[str] | None:
        b = self.batch_groups
        room = b - self.taken
        count = room if count is None else count
        collected = [g for g in self._dispatch_version if g not in self._running]
        if len(collected) < count:
            return None
        collected.sort(key=self._deadline.__getitem__)
        batch = collected[:count]
        chosen = set(batch)
        left = Counter(d for g, d in self._deadline.items() if g not in chosen)
        due = 0
        for j in range(max(left, default=self.version) - self.version + 1):
            due += left.get(self.version + j, 0)
            if due > j * b + room - count:  # the rest of this version, then j more
                return None
        for group_id in batch:
            self.check_trainable(group_id)
            self._forget(group_id)
        self.taken += count
        return batch


@pytest.mark.parametrize("k,b,max_concurrent,seed,streamed", [
    (0, 2, 3, 0, False), (1, 2, 8, 1, False), (2, 3, 7, 2, False), (3, 1, 16, 3, False),
    (3, 4, 19, 4, False), (5, 3, 30, 5, False),
    # a streamed step takes its batch in parts (train.stream_chunks)
    (0, 4, 6, 6, True), (1, 4, 8, 7, True), (3, 6, 19, 8, True)])
def test_counted_window_answers_as_the_recounting_one(k, b, max_concurrent, seed, streamed):
    rng = random.Random(seed)
    windows = [VersionWindow(k, b, max_concurrent), RecountingWindow(k, b, max_concurrent)]
    window, reference = windows
    queued: list[str] = []
    takes = refusals = 0
    for step in range(4000):
        for version in range(window.version - k - 1, window.version + 2):
            assert window.capacity(version) == reference.capacity(version), (step, version)
        running = window.running_groups()
        action = rng.random()
        version = window.version - rng.randrange(k + 1)
        if action < 0.02:  # K changes while groups admitted under another K are in flight
            new_k = rng.randrange(k + 1)
            for w in windows:
                w.set_max_staleness(new_k)
        elif action < 0.45 and window.capacity(version):
            group = queued.pop(0) if queued else f"g{step}"
            assert [w.dispatch(group, version=version) for w in windows] == [version] * 2
        elif action < 0.75 and running:
            group = rng.choice(running)
            for w in windows:
                w.collect(group)
        elif action < 0.8 and running:
            group = rng.choice(running)
            for w in windows:
                w.requeue(group)
            queued.append(group)
        else:
            count = rng.randint(1, b - window.taken) if streamed else None
            batch = window.take_batch(count)
            assert batch == reference.take_batch(count), step
            if batch is None:
                refusals += 1
            else:
                takes += 1
                if window.taken == b:
                    window.advance()
                    reference.advance()
    assert takes > 50 and refusals > 50  # both answers were exercised

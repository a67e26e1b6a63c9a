"""The version window keeps its untaken groups counted per dispatch version (for speed: the
simulator asks for capacity and a batch at every dispatch and collected group). These tests
check the counts against a window that recounts everything from its records at each question,
as the window did before: same capacity at every version, same batch or refusal, through
random dispatches (current and legacy versions), collects, requeues and takes."""

import random
from collections import Counter

import pytest

from eddyrl.core.version_window import VersionWindow


class RecountingWindow(VersionWindow):
    """The reference: `_untaken_due_by` and `take_batch` recount the groups every time."""

    def _untaken_due_by(self, deadline: int) -> int:
        last_version = deadline - self.max_staleness
        return sum(1 for v in self._dispatch_version.values() if v <= last_version)

    def take_batch(self) -> list[str] | None:
        b, k = self.batch_groups, self.max_staleness
        collected = [g for g in self._dispatch_version if g not in self._running]
        if len(collected) < b:
            return None
        collected.sort(key=self._dispatch_version.__getitem__)
        batch = collected[:b]
        chosen = set(batch)
        left = Counter(self._dispatch_version[g] + k for g in self._dispatch_version
                       if g not in chosen)
        due = 0
        for j in range(k + 1):
            due += left.get(self.version + j, 0)
            if due > j * b:
                return None
        for group_id in batch:
            self.check_trainable(self._dispatch_version.pop(group_id))
        self.taken = True
        return batch


@pytest.mark.parametrize("k,b,max_concurrent,seed", [
    (0, 2, 3, 0), (1, 2, 8, 1), (2, 3, 7, 2), (3, 1, 16, 3), (3, 4, 19, 4), (5, 3, 30, 5)])
def test_counted_window_answers_as_the_recounting_one(k, b, max_concurrent, seed):
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
        if action < 0.45 and window.capacity(version):
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
            batch = window.take_batch()
            assert batch == reference.take_batch(), step
            if batch is None:
                refusals += 1
            else:
                takes += 1
                window.advance()
                reference.advance()
    assert takes > 50 and refusals > 50  # both answers were exercised

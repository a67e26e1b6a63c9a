"""verl's in-flight bound in the version window (`max_started_per_sync`): at most
(1 + staleness_threshold)·B groups started per weight sync (a version), the groups still in
flight at the sync (running, or collected and not yet trained) counted against the new
version's budget. Each admission below is worked by hand; the comment says why."""

import pytest

from eddyrl.core.version_window import VersionWindow


def _dispatch(window: VersionWindow, prefix: str, count: int) -> list[str]:
    ids = [f"{prefix}{i}" for i in range(count)]
    for group_id in ids:
        window.dispatch(group_id)
    return ids


def test_verl_budget_counts_starts_not_generating_groups():
    # B = 4, staleness_threshold 0.5: rollout_num = 1.5 x 4 = 6 per sync; generating cap 8
    window = VersionWindow(max_staleness=3, batch_groups=4, max_concurrent=8,
                           max_started_per_sync=6)
    assert window.capacity() == 6  # nothing started yet: the start budget is the bound
    first = _dispatch(window, "a", 4)
    assert window.capacity() == 2  # 6 - 4 started
    for group_id in first:
        window.collect(group_id)
    # Eddy's generating bound alone would now admit 8 (none running); verl's counts the four
    # finished-but-untrained groups as started: 2 left
    assert window.capacity() == 2
    _dispatch(window, "b", 2)
    assert window.capacity() == 0
    assert window.take_batch() == first
    assert window.capacity() == 0  # a batch taken frees nothing until the sync


def test_a_sync_resets_the_count_to_what_is_still_in_flight():
    window = VersionWindow(max_staleness=3, batch_groups=4, max_concurrent=8,
                           max_started_per_sync=6)
    first = _dispatch(window, "a", 4)
    late = _dispatch(window, "b", 2)
    for group_id in first + late[:1]:
        window.collect(group_id)
    assert window.take_batch() == first
    window.advance()
    # carried over: b1 still running and b0 collected but untrained -> 2 of the 6 used
    assert window.started_this_sync == 2
    assert window.capacity() == 4
    _dispatch(window, "c", 4)
    assert window.capacity() == 0


def test_staleness_zero_is_one_batch_per_sync():
    # verl's stream off-policy pipeline: rollout_num = B; nothing is left in flight at a sync
    # once its batch is trained, so the next batch starts only after it
    window = VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=8,
                           max_started_per_sync=2)
    batch = _dispatch(window, "a", 2)
    assert window.capacity() == 0  # K = 1 alone would admit 2 more
    for group_id in batch:
        window.collect(group_id)
    assert window.take_batch() == batch
    window.advance()
    assert window.started_this_sync == 0 and window.capacity() == 2


def test_the_tightest_bound_wins():
    # the generating cap (3) binds before the start budget (6); K = 0 binds before both
    capped = VersionWindow(max_staleness=3, batch_groups=4, max_concurrent=3,
                           max_started_per_sync=6)
    assert capped.capacity() == 3
    sync = VersionWindow(max_staleness=0, batch_groups=2, max_concurrent=8,
                         max_started_per_sync=6)
    assert sync.capacity() == 2  # (K + 1)·B = 2


def test_requeue_gives_the_start_back():
    window = VersionWindow(max_staleness=3, batch_groups=4, max_concurrent=8,
                           max_started_per_sync=6)
    _dispatch(window, "a", 6)
    assert window.capacity() == 0
    window.requeue("a5")  # its worker died: dispatching it again will count it again
    assert window.capacity() == 1
    window.dispatch("a5")
    assert window.capacity() == 0


def test_without_the_bound_the_window_is_unchanged():
    window = VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=4)
    assert window.max_started_per_sync == 0
    batch = _dispatch(window, "a", 2)
    for group_id in batch:
        window.collect(group_id)
    assert window.capacity() == 2  # min(4 - 0 running, (1 + 0 + 1)·2 - 2 accepted)


def test_restore_starts_a_fresh_budget():
    window = VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=8,
                           max_started_per_sync=3)
    window.restore({"version": 5, "accepted": 10})
    assert window.started_this_sync == 0 and window.capacity() == 3


def test_a_negative_bound_is_refused():
    with pytest.raises(Exception, match="max_started_per_sync"):
        VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=8,
                      max_started_per_sync=-1)

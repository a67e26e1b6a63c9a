"""The experience store: per-column readiness, per-consumer consumption, whole groups."""

import pytest

from eddyrl.core.store import ExperienceStore


def _store_with_groups(*sizes):
    store = ExperienceStore()
    rows = [store.add_group(f"g{i}", size, meta={"prompt": i}) for i, size in enumerate(sizes)]
    return store, rows


def _fill(store, rows, column, value=0):
    store.put_many(rows, column, [value] * len(rows))


def test_rows_are_global_and_reserved_per_group():
    store, rows = _store_with_groups(2, 3)
    assert rows == [[0, 1], [2, 3, 4]]
    assert store.add_group("late", 1) == [5]
    with pytest.raises(ValueError, match="'g0'"):
        store.add_group("g0", 2)


def test_readiness_is_per_column():
    store, [rows] = _store_with_groups(2)
    _fill(store, rows, "response", "text")
    assert store.ready_groups("reward", ["response"]) == ["g0"]
    assert store.ready_groups("trainer", ["response", "reward"]) == []
    store.put_many(rows, "reward", [1.0, 0.0])
    assert store.ready_groups("trainer", ["response", "reward"]) == ["g0"]


def test_a_group_with_one_row_missing_a_column_is_not_handed_out():
    store, [rows] = _store_with_groups(3)
    _fill(store, rows, "response")
    store.put_many(rows[:2], "reward", [1.0, 0.0])
    assert store.take("trainer", ["reward"], max_groups=4) is None
    store.put(rows[2], "reward", 0.5)
    [group] = store.take("trainer", ["response", "reward"], max_groups=4)
    assert group.group_id == "g0" and group.rows == rows and group.meta == {"prompt": 0}
    assert group.columns == {"response": [0, 0, 0], "reward": [1.0, 0.0, 0.5]}


def test_each_consumer_sees_each_group_exactly_once():
    store, rows = _store_with_groups(2, 2)
    for r in rows:
        _fill(store, r, "response")
    assert [g.group_id for g in store.take("reward", ["response"], max_groups=8)] == ["g0", "g1"]
    assert store.take("reward", ["response"], max_groups=8) is None  # never twice
    assert store.ready_groups("reward", ["response"]) == []
    # Another consumer has its own view of the same groups.
    assert [g.group_id for g in store.take("trainer", ["response"], max_groups=8)] == ["g0", "g1"]


def test_take_respects_max_and_min_groups_in_insertion_order():
    store, rows = _store_with_groups(1, 1, 1)
    for r in rows:
        _fill(store, r, "reward")
    assert [g.group_id for g in store.take("t", ["reward"], max_groups=2)] == ["g0", "g1"]
    # One left, two wanted: nothing is returned and nothing consumed.
    assert store.take("t", ["reward"], max_groups=2, min_groups=2) is None
    assert store.ready_groups("t", ["reward"]) == ["g2"]
    assert [g.group_id for g in store.take("t", ["reward"], max_groups=2)] == ["g2"]
    assert store.take("t", ["reward"], max_groups=2, min_groups=0) == []
    with pytest.raises(ValueError, match="min_groups"):
        store.take("t", ["reward"], max_groups=1, min_groups=2)


def test_writes_to_unknown_rows_or_twice_name_row_and_column():
    store, [rows] = _store_with_groups(2)
    store.put(rows[0], "reward", 1.0)
    with pytest.raises(ValueError, match=r"row 0, column 'reward': already written"):
        store.put(rows[0], "reward", 2.0)
    with pytest.raises(ValueError, match=r"row 7, column 'reward': unknown row"):
        store.put(7, "reward", 2.0)
    # A batch write with one bad row writes nothing.
    with pytest.raises(ValueError, match=r"row 7"):
        store.put_many([rows[1], 7], "logprobs", [[-0.1], [-0.2]])
    store.put(rows[1], "logprobs", [-0.1])
    with pytest.raises(ValueError, match=r"row 1, column 'x': already written"):
        store.put_many([rows[1], rows[1]], "x", [1, 2])


def test_drop_frees_rows_and_stats_count_per_consumer():
    store, rows = _store_with_groups(2, 3)
    for r in rows:
        _fill(store, r, "reward")
    store.take("trainer", ["reward"], max_groups=1)
    store.ready_groups("reward", ["response"])  # registers what this consumer needs
    stats = store.stats()
    assert (stats.rows, stats.groups) == (5, 2)
    assert stats.ready == {"trainer": 1, "reward": 0}
    assert stats.consumed == {"trainer": 1, "reward": 0}
    store.drop("g0")
    assert (store.stats().rows, store.stats().groups) == (3, 1)
    with pytest.raises(ValueError, match="unknown row"):
        store.put(rows[0][0], "late", 1)  # a straggler writing to a dropped group
    with pytest.raises(ValueError, match="'g0'"):
        store.drop("g0")
    assert store.add_group("g2", 1) == [5]  # indices are never reused


def test_balance_by_tokens_splits_rows_evenly_across_ranks():
    store, rows = _store_with_groups(2, 2)
    store.put_many(rows[0], "tokens", [100, 10])
    store.put_many(rows[1], "tokens", [60, 50])
    groups = store.take("trainer", ["tokens"], max_groups=2)
    parts = store.balance_by_tokens(groups, "tokens", 2)
    # Longest first: 100 -> rank 0, 60 -> rank 1, 50 -> rank 1 (110), 10 -> rank 0 (110).
    assert parts == [[0, 1], [2, 3]]
    loads = [sum({0: 100, 1: 10, 2: 60, 3: 50}[r] for r in part) for part in parts]
    assert loads == [110, 110]
    with pytest.raises(ValueError, match="column 'missing'"):
        store.balance_by_tokens(groups, "missing", 2)


def test_take_groups_hands_out_chosen_groups_all_or_nothing():
    store = ExperienceStore()
    rows = {group: store.add_group(group, 2) for group in ("a", "b", "c")}
    for group in rows:
        store.put_many(rows[group], "response", ["x", "y"])
    store.put_many(rows["a"], "reward", [1.0, 0.0])
    store.put_many(rows["c"], "reward", [0.5, 0.5])
    assert store.is_complete("a", ["response", "reward"])
    assert not store.is_complete("b", ["response", "reward"])
    with pytest.raises(ValueError, match="group 'b' is not ready"):
        store.take_groups("trainer", ["c", "b"], ["response", "reward"])
    assert store.ready_groups("trainer", ["response", "reward"]) == ["a", "c"]  # nothing taken
    taken = store.take_groups("trainer", ["c", "a"], ["response", "reward"])
    assert [g.group_id for g in taken] == ["c", "a"]
    assert taken[1].columns == {"response": ["x", "y"], "reward": [1.0, 0.0]}
    with pytest.raises(ValueError, match="already consumed"):
        store.take_groups("trainer", ["a"], ["response"])
    with pytest.raises(ValueError, match="'zz' is not in the store"):
        store.take_groups("trainer", ["zz"], ["response"])

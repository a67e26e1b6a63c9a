"""The experience store: per-column completeness, whole groups taken out once per consumer."""

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
    assert store.take_groups("trainer", ["a"], ["response", "reward"])  # nothing was taken
    store.drop("a")
    with pytest.raises(ValueError, match="row 0, column 'extra': unknown row"):
        store.put(rows["a"][0], "extra", 1)  # a late write to a dropped group fails loudly
    [taken] = store.take_groups("trainer", ["c"], ["response", "reward"])
    assert taken.group_id == "c" and taken.meta == {}
    assert taken.columns == {"response": ["x", "y"], "reward": [0.5, 0.5]}
    with pytest.raises(ValueError, match="already consumed"):
        store.take_groups("trainer", ["c"], ["response"])
    store.take_groups("scorer", ["c"], ["response"])  # another consumer takes it once too
    with pytest.raises(ValueError, match="'zz' is not in the store"):
        store.take_groups("trainer", ["zz"], ["response"])

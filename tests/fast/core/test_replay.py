"""ReFlow replay: the σ cap, the τ weight, δ lag eviction at the boundary, the reuse bound,
capacity eviction, the selection order, config validation, and randomized invariants."""

import random
from dataclasses import dataclass

import pytest

from eddyrl.core.replay import ReplayBuffer, ReplayConfig
from eddyrl.errors import ConfigError


@dataclass(frozen=True)
class G:  # the buffer needs only a group_id
    group_id: str


def _buffer(**overrides):
    config = ReplayConfig(**{"max_fraction": 0.5, "loss_weight": 0.25, "max_lag": 2,
                             "max_reuse": 2, "capacity": 8, **overrides})
    config.validate("replay")
    return ReplayBuffer(config)


def _ids(selected):
    return [group.group_id for group, _ in selected]


def test_replay_off_by_default_keeps_nothing():
    buffer = ReplayBuffer(ReplayConfig())
    assert buffer.add(G("a"), 0, True) is False
    assert len(buffer) == 0 and buffer.select(8, 1) == []


@pytest.mark.parametrize("sigma,b,cap", [(0.5, 5, 2), (0.25, 8, 2), (0.29, 100, 29),
                                         (0.1, 9, 0), (1.0, 3, 3)])
def test_sigma_caps_replayed_groups_at_floor_sigma_b(sigma, b, cap):
    buffer = _buffer(max_fraction=sigma, capacity=200, max_reuse=5)
    for i in range(150):
        buffer.add(G(f"g{i}"), 5, True)
    assert buffer.replay_slots(b) == cap
    selected = buffer.select(b, trainer_version=6)
    assert len(selected) == cap
    assert all(weight == 0.25 for _, weight in selected)  # τ on every replayed group


def test_lag_exactly_delta_is_allowed_and_delta_plus_one_is_evicted():
    buffer = _buffer(max_fraction=1.0, max_lag=2)
    buffer.add(G("at_delta"), 3, True)
    buffer.add(G("too_old"), 2, True)
    assert _ids(buffer.select(4, trainer_version=5)) == ["at_delta"]
    assert buffer.evicted_since_last() == [("too_old", "lag")]
    assert "too_old" not in buffer and "at_delta" in buffer
    assert buffer.evicted_since_last() == []  # drained


def test_reuse_bound_evicts_after_the_last_allowed_use():
    buffer = _buffer(max_fraction=1.0, max_reuse=2, max_lag=10)
    buffer.add(G("a"), 0, True)
    assert _ids(buffer.select(1, 1)) == ["a"]
    assert _ids(buffer.select(1, 2)) == ["a"]  # second use: returned, then evicted
    assert buffer.evicted_since_last() == [("a", "reuse")]
    assert buffer.select(1, 3) == []
    assert buffer.stats()["selected_total"] == 2 and buffer.stats()["evicted_reuse"] == 1


def test_capacity_evicts_the_oldest_behaviour_version_then_the_first_added():
    buffer = _buffer(capacity=3)
    buffer.add(G("v5"), 5, True)
    buffer.add(G("v4a"), 4, True)
    buffer.add(G("v4b"), 4, True)
    buffer.add(G("v6"), 6, True)
    assert buffer.evicted_since_last() == [("v4a", "capacity")]
    buffer.add(G("v7"), 7, True)
    assert buffer.evicted_since_last() == [("v4b", "capacity")]
    assert len(buffer) == 3 and buffer.stats()["evicted_capacity"] == 2


def test_selection_prefers_informative_then_recent_then_fifo():
    buffer = _buffer(max_fraction=1.0, max_reuse=9, max_lag=9)
    buffer.add(G("flat_new"), 4, False)
    buffer.add(G("inf_old"), 2, True)
    buffer.add(G("inf_new_first"), 3, True)
    buffer.add(G("inf_new_second"), 3, True)
    assert _ids(buffer.select(4, 5)) == ["inf_new_first", "inf_new_second", "inf_old",
                                         "flat_new"]
    assert _ids(buffer.select(2, 5)) == ["inf_new_first", "inf_new_second"]


def test_duplicate_add_raises():
    buffer = _buffer()
    buffer.add(G("a"), 0, True)
    with pytest.raises(ValueError, match="'a' is already"):
        buffer.add(G("a"), 1, True)


@pytest.mark.parametrize("overrides,match", [
    ({"max_fraction": 1.5}, r"'replay.max_fraction' = 1.5 .*\[0, 1\]"),
    ({"loss_weight": -0.1}, r"'replay.loss_weight' = -0.1"),
    ({"max_lag": -1}, r"'replay.max_lag' = -1"),
    ({"max_reuse": 0}, r"'replay.max_reuse' = 0"),
    ({"capacity": 0}, r"'replay.capacity' = 0"),
    ({"max_fraction": 0.25, "loss_weight": 0.0}, r"contradictory.*loss_weight = 0"),
    ({"max_fraction": 0.25, "max_lag": 0}, r"contradictory.*max_lag = 0"),
])
def test_validate_names_key_value_and_allowed(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ReplayConfig(**overrides).validate("replay")


def test_replay_off_tolerates_settings_that_only_matter_when_on():
    ReplayConfig(max_fraction=0.0, loss_weight=0.0, max_lag=0).validate("replay")


@pytest.mark.parametrize("seed", range(3))
def test_randomized_invariants_hold_and_are_deterministic(seed):
    """Random adds and selections: never more than floor(σB), never a group past δ, never more
    than max_reuse uses, never above capacity, every group accounted for; the same calls give
    the same answers."""
    def run():
        rng = random.Random(seed)
        config = ReplayConfig(max_fraction=0.375, loss_weight=0.5, max_lag=3, max_reuse=3,
                              capacity=20)
        buffer, behaviour, uses, trace = ReplayBuffer(config), {}, {}, []
        version = 0
        for i in range(2000):
            if rng.random() < 0.6:
                gid = f"g{i}"
                behaviour[gid] = version - rng.randrange(3)
                buffer.add(G(gid), behaviour[gid], rng.random() < 0.7)
            else:
                b = rng.randrange(1, 17)
                selected = buffer.select(b, version)
                assert len(selected) <= int(0.375 * b)
                for group, weight in selected:
                    assert version - behaviour[group.group_id] <= 3 and weight == 0.5
                    uses[group.group_id] = uses.get(group.group_id, 0) + 1
                    assert uses[group.group_id] <= 3
                trace.append(_ids(selected))
                version += int(rng.random() < 0.5)
            assert len(buffer) <= 20
            trace.extend(buffer.evicted_since_last())
        stats = buffer.stats()
        evicted = stats["evicted_lag"] + stats["evicted_reuse"] + stats["evicted_capacity"]
        assert stats["added_total"] == stats["size"] + evicted
        assert stats["selected_total"] == sum(uses.values())
        return trace

    assert run() == run()

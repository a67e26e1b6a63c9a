"""A reward function that raises, returns NaN or is missing never stops a run silently."""

import math

import pytest

from eddyrl.core.rewarding import SafeReward, load_reward_fn
from eddyrl.errors import ConfigError


def test_raising_and_nan_rewards_are_zero_recorded_and_counted():
    def flaky(response, answer):
        if response == "boom":
            raise ValueError("cannot parse")
        return math.nan if response == "nan" else 1.0

    safe = SafeReward(flaky)
    assert safe("ok", "1") == (1.0, None)
    value, error = safe("boom", "1")
    assert value == 0.0 and error == "ValueError: cannot parse"
    value, error = safe("nan", "1")
    assert value == 0.0 and "nan" in error
    assert safe.errors == 2 and len(safe.last_errors) == 2


def test_load_reward_fn_errors_name_the_key():
    assert load_reward_fn("eddyrl.tasks.reward:reward")("1 = 1", "1") == 1.0
    with pytest.raises(ConfigError, match="'data.reward_fn' = 'nope.mod:f'.*cannot be imported"):
        load_reward_fn("nope.mod:f")
    with pytest.raises(ConfigError, match="'data.reward_fn' = 'eddyrl.tasks.reward:missing': "
                                          "module 'eddyrl.tasks.reward' has no attribute "
                                          "'missing'"):
        load_reward_fn("eddyrl.tasks.reward:missing")
    with pytest.raises(ConfigError, match="'data.reward_fn' = 'eddyrl.tasks.reward:re': the "
                                          "object is a module, not a callable"):
        load_reward_fn("eddyrl.tasks.reward:re")

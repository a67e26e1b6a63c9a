"""`data.reward_timeout_s`: a limit of 0 is refused naming the config key, and the limit set is
the one the reward a run scores with (`eddyrl.launch.prepare`, on the tiny model) holds. (What the
limit does to a hanging reward: test_reward_errors.py.)"""

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError


def test_reward_timeout_setting(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["data.reward_timeout_s=0"])
    assert str(error.value) == ("config key 'data.reward_timeout_s' = 0.0 is out of range; "
                                "allowed: (0, inf)")
    from eddyrl.launch import prepare

    config = load_config(overrides=["data.reward_timeout_s=0.5", "data.train_size=4",
                                    "data.eval_size=2"])
    reward = prepare(config, tiny_model_dir, tmp_path).reward
    assert reward.timeout_s == 0.5  # what a run scores with

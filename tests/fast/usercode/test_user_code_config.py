"""The `user_code` config section: worker threads by default, choices and ranges checked with
the key named, process mode refused at start-up for what cannot be sent to a worker process.
(`eddy train`'s preparation building and closing the pools: test_user_code_pools.py.)"""

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError
from eddyrl.usercode.config import WorkersConfig


def test_rewards_and_environments_run_on_worker_threads_by_default():
    config = load_config()
    assert (config.user_code.reward.mode, config.user_code.reward.workers) == ("thread", 4)
    assert (config.user_code.env.mode, config.user_code.env.workers) == ("thread", 32)
    config = load_config(overrides=["user_code.reward.mode=process",
                                    "user_code.env.mode=inline", "user_code.env.workers=2"])
    assert (config.user_code.reward.mode, config.user_code.env.mode) == ("process", "inline")


@pytest.mark.parametrize("override, message", [
    ("user_code.reward.mode=procss", "config key 'user_code.reward.mode' = 'procss' is not "
                                     "allowed; choose one of 'thread', 'process', 'inline'; "
                                     "did you mean 'process'?"),
    ("user_code.env.workers=0", "config key 'user_code.env.workers' = 0 is out of range; "
                                "allowed: [1, 1024]"),
    ("user_code.reward.worker=2", "unknown config key 'user_code.reward.worker' in the "
                                  "command-line overrides; did you mean "
                                  "'user_code.reward.workers'?"),
])
def test_bad_user_code_settings_name_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[override])
    assert str(error.value).startswith(message)


def test_process_mode_refuses_what_cannot_be_sent_to_a_worker_process():
    with pytest.raises(ConfigError) as error:
        WorkersConfig(mode="process").build(
            "user_code.reward", name="reward",
            sent=(("data.reward_fn 'x:y'", lambda response, answer: 1.0),))
    assert str(error.value).startswith(
        "config key 'user_code.reward.mode' = 'process': data.reward_fn 'x:y' cannot be sent "
        "to a worker process")
    pool = WorkersConfig(mode="thread").build("user_code.reward", name="reward",
                                              sent=(("fn", lambda r, a: 1.0),))
    assert pool.mode == "thread"  # threads take any callable
    pool.close()

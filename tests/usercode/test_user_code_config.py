"""The `user_code` config section: worker threads by default, choices and ranges checked with
the key named, process mode refused at start-up for what cannot be sent to a worker process,
and `eddy train`'s preparation building (and closing) the pools it describes."""

import asyncio
import os
import time

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


@pytest.mark.integration  # the tiny model's tokenizer, worker processes
def test_prepare_builds_the_pools_user_code_describes_and_closes_them(tiny_model_dir,
                                                                       tmp_path):
    from eddyrl.envs.hosting import EnvHost
    from eddyrl.launch import prepare

    config = load_config(overrides=[
        "data.task=tool_add", "env.name=calculator", "env.options.syntax=tiny",
        "data.train_size=4", "data.eval_size=2", "user_code.reward.mode=process",
        "user_code.reward.workers=1", "user_code.env.mode=process", "user_code.env.workers=1"])
    run = prepare(config, tiny_model_dir, tmp_path)
    settings, reward = run.settings, run.reward
    assert isinstance(settings.env, EnvHost) and settings.env.mode == "process"
    assert reward.pool.mode == "process" and reward.timeout_s == 60.0

    async def scenario():
        return await reward.score("3 8 16 = 16", "16"), reward.pool.pids

    (score, pids) = asyncio.run(scenario())
    assert score == (1.0, None) and len(pids) == 1 and pids[0] != os.getpid()
    run.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(pids[0]):
        time.sleep(0.05)
    assert not _alive(pids[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

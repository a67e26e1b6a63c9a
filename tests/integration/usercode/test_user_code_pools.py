"""`eddy train`'s preparation builds the worker pools the `user_code` section describes (here
worker processes, for the reward and the tool environment) and closes them with the run. (The
section's defaults and checks: test_user_code_config.py.)"""

import asyncio
import os
import time

import pytest

from eddyrl.config import load_config


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

"""The `env` config section: validation naming the key, bundled names, options, and building
the episode factory at start-up."""

import asyncio

import pytest
from omegaconf import OmegaConf

from eddyrl.envs import Action
from eddyrl.envs.calculator import TINY_SYNTAX, CalculatorEnv
from eddyrl.envs.config import EnvConfig
from eddyrl.errors import ConfigError

REWARD = "eddyrl.tasks.reward:reward"


def test_no_name_is_single_turn(spy):
    assert EnvConfig().build("env", tokenizer=spy, reward_fn=REWARD) is None


def test_yaml_to_a_working_factory(spy):
    yaml = "name: calculator\nmax_turns: 3\noptions: {syntax: tiny}\n"
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig),
                                                 OmegaConf.create(yaml)))
    factory = config.build("env", tokenizer=spy, reward_fn=REWARD, payload_bytes=[10, 20])
    env = factory(prompt="add 1 2", answer="3")
    assert isinstance(env, CalculatorEnv) and env.syntax == TINY_SYNTAX
    assert (env.limits.max_turns, env.payload_bytes) == (3, (10, 20))
    assert asyncio.run(env.step(Action((1,), "= 3"))).reward == 1.0  # data.reward_fn


def test_options_reward_fn_overrides_data_reward_fn(spy):
    config = EnvConfig(name="calculator", options={"reward_fn": "eddyrl.no.such:fn"})
    with pytest.raises(ConfigError, match="'env.options.reward_fn' = 'eddyrl.no.such:fn'"):
        config.build("env", tokenizer=spy, reward_fn=REWARD)
    with pytest.raises(ConfigError, match="'data.reward_fn' = 'nope'"):
        EnvConfig(name="calculator").build("env", tokenizer=spy, reward_fn="nope")


@pytest.mark.parametrize("changes, key", [
    (dict(max_turns=0), "env.max_turns"),
    (dict(max_observation_tokens=0), "env.max_observation_tokens"),
    (dict(step_timeout_s=0.0), "env.step_timeout_s"),
    (dict(name="calculater"), "env.name.*bundled.*did you mean 'calculator'"),
    (dict(name="calculator", options={"syntax": "xml"}), "env.options.syntax"),
    (dict(name="calculator", options={"max_digits": 3}), "env.name"),
])
def test_problems_name_the_key(spy, changes, key):
    config = EnvConfig(**changes)
    with pytest.raises(ConfigError, match=key):
        config.validate("env")
        config.build("env", tokenizer=spy, reward_fn=REWARD)


def test_a_constructor_failure_is_a_config_error(spy, tmp_path, monkeypatch):
    (tmp_path / "bad_env.py").write_text("def make(**kwargs):\n    raise OSError('no disk')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="building an environment failed .OSError: no disk"):
        EnvConfig(name="bad_env:make").build("env", tokenizer=spy, reward_fn=REWARD)

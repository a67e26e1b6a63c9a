"""Bad environment code: an environment that cannot be loaded fails at start-up naming
`env.name`; one that raises, returns a NaN reward, hangs past `env.step_timeout_s` or cannot
be built mid-run ends its episode with `env.cutoff_reward`, recorded and counted
(`env/errors`, `env/ended_by/<reason>`), and the turns it already produced are kept."""

import asyncio

import pytest

from eddyrl.core.episodes import Episodes
from eddyrl.protocol import GenerationResult
from eddyrl.envs import Environment, EpisodeLimits, Reply
from eddyrl.envs.config import EnvConfig
from eddyrl.envs.loading import EnvironmentFactory
from eddyrl.errors import ConfigError


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class Faulty(Environment):
    def __init__(self, *, fault: str, **base) -> None:
        super().__init__(**base)
        if fault == "build":
            raise OSError("sandbox image not found")
        self.fault = fault

    async def respond(self, action):
        if self.fault == "raise":
            raise KeyError("tool server down")
        if self.fault == "hang":
            await asyncio.sleep(30)
        return Reply(done=True, reward=float("nan"))


def episode_of(fault: str):
    """One turn of an episode in an environment with `fault`, through the rollout's path."""
    limits = EpisodeLimits(step_timeout_s=0.2, cutoff_reward=-1.0)
    factory = EnvironmentFactory(Faulty, "tests:Faulty",
                                 dict(tokenizer=CharTokenizer(), limits=limits, fault=fault))
    episodes = Episodes(factory, decode=lambda ids: "".join(map(chr, ids)))
    run = episodes.start(max_tokens=64, training=True)
    turn = GenerationResult("r0", [1, 2, 3], [104, 105], [-0.5, -0.25], [7, 7], "stop")
    observation, episode = asyncio.run(episodes.take_turn(run, turn, prompt="p", answer="a"))
    return episodes, run, turn, episode


@pytest.mark.parametrize("fault, ended_by, error", [
    pytest.param("raise", "error", "KeyError: 'tool server down'", id="step-raises"),
    pytest.param("nan", "error", "environment reward nan", id="nan-reward"),
    pytest.param("hang", "timeout", "environment step took longer than env.step_timeout_s=0.2s",
                 id="step-hangs"),
    pytest.param("build", "error", "OSError: sandbox image not found", id="build-fails"),
])
def test_failing_environment_ends_its_episode_counted(fault, ended_by, error):
    episodes, run, turn, episode = episode_of(fault)
    assert (episode.ended_by, episode.reward, episode.error) == (ended_by, -1.0, error)
    metrics = episodes.stats.metrics()
    assert metrics["env/errors"] == 1.0 and metrics[f"env/ended_by/{ended_by}"] == 1.0
    assert metrics["env/episodes"] == 1.0 and episodes.stats.last_errors == [error]
    # the model's turn is kept as the training sample, trained on, with its log-probs
    sample = episodes.result(run, turn)
    assert (sample.token_ids, sample.logprobs, sample.versions, sample.loss_mask) == \
        ([104, 105], [-0.5, -0.25], [7, 7], [1, 1])


def test_environment_path_that_does_not_load_names_env_name():
    with pytest.raises(ConfigError) as error:
        EnvConfig(name="eddyrl.envs.calculator:Calculater").build(
            "env", tokenizer=CharTokenizer(), reward_fn="eddyrl.tasks.reward:reward")
    assert str(error.value) == ("config key 'env.name' = 'eddyrl.envs.calculator:Calculater': "
                                "module 'eddyrl.envs.calculator' has no attribute 'Calculater'")


def test_unknown_environment_option_names_the_argument():
    with pytest.raises(ConfigError) as error:
        EnvConfig(name="calculator", options={"syntx": "tiny"}).build(
            "env", tokenizer=CharTokenizer(), reward_fn="eddyrl.tasks.reward:reward")
    assert str(error.value).startswith("config key 'env.name' = "
                                       "'eddyrl.envs.calculator:CalculatorEnv': unknown "
                                       "arguments syntx (it takes: ")

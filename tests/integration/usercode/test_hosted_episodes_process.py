"""Episodes whose environments live in the user-code pool's worker processes: built there from
the factory (sent once per process: its tokenizer too, the tiny model's included), stepped
there across turns; a segfault or a hang past `env.step_timeout_s` ends the episodes living in
that process with the cutoff reward and why (the one that hung: "timeout"), the process is
replaced and later episodes run; a factory that cannot be sent is refused at start-up by its
config key.

Integration: every test starts processes."""

import asyncio
import os

import pytest
from usercode_fixtures import CharTokenizer, Misbehaving

from eddyrl.core.episodes import Episodes
from eddyrl.envs import EpisodeLimits
from eddyrl.envs.config import EnvConfig
from eddyrl.envs.hosting import host_environments
from eddyrl.envs.loading import EnvironmentFactory
from eddyrl.errors import ConfigError
from eddyrl.protocol import GenerationResult
from eddyrl.usercode.config import WorkersConfig

pytestmark = pytest.mark.integration

LIMIT = 0.3  # env.step_timeout_s
CUTOFF = -1.0


def episodes_of(script, *, workers=1, tokenizer=None, limit=LIMIT) -> Episodes:
    limits = EpisodeLimits(step_timeout_s=limit, cutoff_reward=CUTOFF)
    factory = EnvironmentFactory(Misbehaving, "tests:Misbehaving", dict(
        tokenizer=tokenizer or CharTokenizer(), limits=limits, script=script))
    host = host_environments(factory, WorkersConfig(mode="process", workers=workers))
    return Episodes(host, decode=CharTokenizer().decode)


def turn(run, new=(104, 105)) -> GenerationResult:
    ids = list(run.state.transcript.token_ids) + list(new)
    return GenerationResult("r0", [1, 2, 3], ids, [-0.5] * len(ids), [7] * len(ids), "stop")


async def take(episodes, run, prompt="p"):
    return await episodes.take_turn(run, turn(run), prompt=prompt, answer="a")


def _home(observation) -> int:
    return int(CharTokenizer().decode(observation.token_ids).split()[0])


def test_an_environment_lives_in_a_worker_process_across_its_turns():
    async def scenario():
        episodes = episodes_of(("where", "where", "done"))
        run = episodes.start(max_tokens=200, training=True)
        first, _ = await take(episodes, run)
        second, _ = await take(episodes, run)
        _, episode = await take(episodes, run)  # its turn 3: the same environment
        assert episode.ended_by == "env" and episode.reward == 1.0
        episodes.host.close()
        return _home(first), _home(second)

    first, second = asyncio.run(scenario())
    assert first == second != os.getpid()


def test_a_segfault_ends_the_episodes_in_that_process_and_the_next_ones_run():
    async def scenario():
        episodes = episodes_of({"crash": ("segfault",), "next": ("where", "done")})
        _, episode = await take(episodes, episodes.start(200, True), prompt="crash")
        assert (episode.ended_by, episode.reward) == ("error", CUTOFF)
        assert episode.error == ("environment worker lost: its worker process died (SIGSEGV) "
                                 "and was replaced")
        run = episodes.start(200, True)
        observation, _ = await take(episodes, run, prompt="next")
        _, episode = await take(episodes, run, prompt="next")
        assert episode.reward == 1.0 and _home(observation) != os.getpid()
        metrics = episodes.stats.metrics()
        assert metrics["env/errors"] == 1 and metrics["env/ended_by/error"] == 1
        episodes.host.close()

    asyncio.run(scenario())


def test_a_step_that_hangs_gets_its_process_killed_with_every_episode_living_there():
    async def scenario():
        episodes = episodes_of({"hang": ("sleep",), "bystander": ("ok", "done"),
                                "next": ("done",)})
        bystander = episodes.start(200, True)
        await take(episodes, bystander, prompt="bystander")  # lives in the only process
        _, hung = await take(episodes, episodes.start(200, True), prompt="hang")
        assert (hung.ended_by, hung.reward) == ("timeout", CUTOFF)
        assert hung.error == (f"environment step took longer than env.step_timeout_s={LIMIT}s "
                              "(its worker process was killed and replaced)")
        _, episode = await take(episodes, bystander, prompt="bystander")
        assert (episode.ended_by, episode.reward) == ("error", CUTOFF)
        assert episode.error == ("environment worker lost: its worker process was killed: "
                                 "another call on it ran past its limit")
        _, episode = await take(episodes, episodes.start(200, True), prompt="next")
        assert episode.reward == 1.0  # in the fresh process
        metrics = episodes.stats.metrics()
        assert metrics["env/ended_by/timeout"] == 1 and metrics["env/ended_by/error"] == 1
        assert episodes.report()["workers_replaced"] == 1
        episodes.host.close()

    asyncio.run(scenario())


def test_a_factory_that_cannot_be_sent_to_a_worker_process_is_refused_by_its_key():
    class Local(CharTokenizer):  # defined in a function: pickle cannot name it
        pass

    with pytest.raises(ConfigError, match="config key 'user_code.env.mode' = 'process': the "
                                          "shared object cannot be sent to a worker process"):
        episodes_of(("done",), tokenizer=Local())


def test_a_bundled_environment_with_the_tiny_models_tokenizer_runs_in_a_worker_process():
    from eddyrl.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    factory = EnvConfig(name="calculator", options={"syntax": "tiny"}).build(
        "env", tokenizer=tokenizer, reward_fn="eddyrl.tasks.reward:reward")
    episodes = Episodes(host_environments(factory, WorkersConfig(mode="process", workers=1)),
                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    def result(run, text):
        ids = list(run.state.transcript.token_ids) + \
            tokenizer.encode(text, add_special_tokens=False)
        return GenerationResult("r0", [1], ids, [-0.5] * len(ids), [0] * len(ids), "stop")

    async def scenario():
        run = episodes.start(max_tokens=200, training=True)
        observation, _ = await episodes.take_turn(run, result(run, "calc:1+2#"), "add 1 2",
                                                  "3")
        _, episode = await episodes.take_turn(run, result(run, "= 3"), "add 1 2", "3")
        episodes.host.close()
        return observation, episode

    observation, episode = asyncio.run(scenario())
    assert tokenizer.decode(observation.token_ids) == "result:3\n"
    assert (episode.ended_by, episode.reward) == ("env", 1.0)

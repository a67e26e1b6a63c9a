"""Episodes whose environments live on the user-code pool's worker threads (and inline, as
before): built, stepped and closed off the caller's loop, each on its own event loop; a
`respond()` that blocks its thread past `env.step_timeout_s` ends its episode ("timeout",
cutoff reward, counted) and holds up no other episode; SystemExit, a reward that is not a
number and a failed construction end their episode ("error", counted); a KeyboardInterrupt is
raised on (tests/integration/usercode/test_hosted_episodes_process.py: in worker processes)."""

import asyncio
import os
import threading

import pytest
from usercode_fixtures import CharTokenizer, Misbehaving

from eddyrl.core.episodes import Episodes
from eddyrl.envs import EpisodeLimits
from eddyrl.envs.hosting import EnvHost, grace_s
from eddyrl.envs.loading import EnvironmentFactory
from eddyrl.protocol import GenerationResult
from eddyrl.usercode import make_pool

LIMIT = 0.3  # env.step_timeout_s; a step that blocks is cut off after LIMIT + grace_s(LIMIT)
CUTOFF = -1.0


@pytest.fixture
def release():
    event = threading.Event()
    yield event
    event.set()  # threads still blocked go free


def episodes_of(script, mode="thread", *, workers=2, limit=LIMIT, **options) -> Episodes:
    limits = EpisodeLimits(step_timeout_s=limit, cutoff_reward=CUTOFF)
    factory = EnvironmentFactory(Misbehaving, "tests:Misbehaving", dict(
        tokenizer=CharTokenizer(), limits=limits, script=script, **options))
    pool = make_pool(mode, workers, name="environment", shared=factory)
    return Episodes(EnvHost(factory, pool), decode=CharTokenizer().decode)


def turn(run, new=(104, 105)) -> GenerationResult:
    """The engine's result for the episode's next turn: its transcript, then `new`."""
    ids = list(run.state.transcript.token_ids) + list(new)
    return GenerationResult("r0", [1, 2, 3], ids, [-0.5] * len(ids), [7] * len(ids), "stop")


async def take(episodes, run, prompt="p"):
    return await episodes.take_turn(run, turn(run), prompt=prompt, answer="a")


def test_an_environment_is_built_stepped_and_closed_on_worker_threads():
    async def scenario():
        episodes = episodes_of(("where", "done"))
        run = episodes.start(max_tokens=200, training=True)
        observation, episode = await take(episodes, run)
        assert episode is None
        where = CharTokenizer().decode(observation.token_ids)
        second, episode = await take(episodes, run)  # the same environment: its turn 2
        assert (episode.ended_by, episode.reward) == ("env", 1.0) and run.env is None
        episodes.host.close()
        return where

    pid, thread = asyncio.run(scenario()).split()
    assert int(pid) == os.getpid() and thread.startswith("eddy-environment-")


def test_a_step_that_blocks_past_the_limit_ends_its_episode_and_the_next_one_runs(release):
    async def scenario():
        episodes = episodes_of({"stuck": ("block",), "next": ("done",)}, workers=1,
                               release=release)
        stuck = episodes.start(max_tokens=200, training=True)
        _, episode = await take(episodes, stuck, prompt="stuck")
        assert (episode.ended_by, episode.reward) == ("timeout", CUTOFF)
        assert episode.error.startswith(
            f"environment step took longer than env.step_timeout_s={LIMIT}s (its thread was "
            "abandoned")
        _, episode = await take(episodes, episodes.start(200, True), prompt="next")
        assert (episode.ended_by, episode.reward) == ("env", 1.0)  # on a fresh thread
        metrics = episodes.stats.metrics()
        assert metrics["env/errors"] == 1 and metrics["env/ended_by/timeout"] == 1
        assert episodes.report()["workers_replaced"] == 1
        episodes.host.close()

    asyncio.run(scenario())
    assert grace_s(LIMIT) < 2  # what the wait above was bounded by, besides the limit


def test_a_blocking_step_holds_up_only_its_own_episode(release):
    async def scenario():
        episodes = episodes_of({"stuck": ("block", "done"), "free": ("ok", "done")},
                               limit=30.0, release=release)
        stuck = episodes.start(max_tokens=200, training=True)
        blocked = asyncio.ensure_future(take(episodes, stuck, prompt="stuck"))
        free = episodes.start(max_tokens=200, training=True)
        assert (await take(episodes, free, prompt="free"))[1] is None
        _, episode = await take(episodes, free, prompt="free")
        assert episode.ended_by == "env" and not blocked.done()  # two turns, still blocked
        release.set()
        observation, episode = await blocked
        assert episode is None and observation.token_ids == tuple(map(ord, "ok"))
        episodes.host.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["thread", "inline"])
@pytest.mark.parametrize("prompt, script, error", [
    ("p", ("exit",), "SystemExit: 1"),
    ("p", ("high",), "environment reward 'high' is not a number"),
    ("unbuildable", ("done",), "OSError: sandbox image not found"),
])
def test_an_environment_that_exits_returns_no_number_or_cannot_be_built_ends_its_episode(
        mode, prompt, script, error):
    async def scenario():
        episodes = episodes_of(script, mode)
        run = episodes.start(max_tokens=200, training=True)
        _, episode = await take(episodes, run, prompt=prompt)
        assert (episode.ended_by, episode.reward, episode.error) == ("error", CUTOFF, error)
        metrics = episodes.stats.metrics()
        assert metrics["env/errors"] == 1 and metrics["env/ended_by/error"] == 1
        assert episodes.stats.last_errors == [error]
        # the model's turn is kept as the training sample
        assert episodes.result(run, turn(run, ())).loss_mask == [1, 1]
        episodes.host.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_keyboard_interrupt_in_an_environment_stops_the_run(mode):
    episodes = episodes_of(("interrupt",), mode)
    run = episodes.start(max_tokens=200, training=True)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(take(episodes, run))
    episodes.host.close()


def test_a_bare_factory_runs_its_environments_inline_as_before():
    limits = EpisodeLimits(cutoff_reward=CUTOFF)
    factory = EnvironmentFactory(Misbehaving, "tests:Misbehaving", dict(
        tokenizer=CharTokenizer(), limits=limits, script=("where", "done")))
    episodes = Episodes(factory, decode=CharTokenizer().decode)
    assert episodes.host.mode == "inline" and episodes.report().keys() == {
        "turns", "episodes", "errors", "tool_seconds", "restarted_episodes", "last_errors",
        "eval"}

    async def scenario():
        run = episodes.start(max_tokens=200, training=True)
        observation, _ = await take(episodes, run)
        return CharTokenizer().decode(observation.token_ids)

    assert asyncio.run(scenario()).split()[1] == threading.main_thread().name

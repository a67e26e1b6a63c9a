"""User code off the controller's event loop, through the real streaming rollout (scripted
engines, tests/support/scripted_engine.py): an environment step or a reward that blocks its
worker thread holds up only its own episode or sample — the other requests finish and form
batches meanwhile — and one that blocks past its limit costs its episode or sample (cutoff
reward / 0, counted) while the run goes on."""

import asyncio
import sys
import threading
from pathlib import Path

import pytest
from usercode_fixtures import CharTokenizer, Misbehaving, blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core"))
from scripted_engine import STOP, ScriptedEngine  # noqa: E402

from eddyrl.core.episodes import Episodes, NoEpisodes  # noqa: E402
from eddyrl.core.ledger import Ledger  # noqa: E402
from eddyrl.core.rewarding import SafeReward  # noqa: E402
from eddyrl.core.rollout import StreamingRollout  # noqa: E402
from eddyrl.core.version_assignment import VersionAssignment  # noqa: E402
from eddyrl.core.version_window import VersionWindow  # noqa: E402
from eddyrl.envs import EpisodeLimits  # noqa: E402
from eddyrl.envs.hosting import EnvHost  # noqa: E402
from eddyrl.envs.loading import EnvironmentFactory  # noqa: E402
from eddyrl.protocol import Group, SamplingParams  # noqa: E402
from eddyrl.runtime.inprocess import InProcessRuntime  # noqa: E402
from eddyrl.usercode import ThreadPool  # noqa: E402

LIMIT = 0.3
CUTOFF = -1.0
WAIT_S = 60  # "did not hang": far beyond anything these scenarios need


@pytest.fixture
def release():
    event = threading.Event()
    yield event
    event.set()  # threads still blocked go free


def _rollout(reward, episodes=None, batch=1):
    decode = CharTokenizer().decode
    window = VersionWindow(max_staleness=1, batch_groups=batch, max_concurrent=8)
    return StreamingRollout(InProcessRuntime([ScriptedEngine(10)]), window,
                            VersionAssignment(1, 64), Ledger(), reward, decode,
                            episodes=episodes or NoEpisodes())


def _threaded_episodes(script, limit, release) -> Episodes:
    factory = EnvironmentFactory(Misbehaving, "tests:Misbehaving", dict(
        tokenizer=CharTokenizer(), limits=EpisodeLimits(step_timeout_s=limit,
                                                        cutoff_reward=CUTOFF),
        script=script, release=release))
    return Episodes(EnvHost(factory, ThreadPool(4, name="environment", shared=factory)),
                    decode=CharTokenizer().decode)


def _dispatch(rollout, *names, answer="1"):
    for name in names:
        rollout.ledger.queue(name, len(rollout.ledger.counts()), 0)
        rollout.dispatch([Group(name, name, answer if name != "fast" else "1", [5, 6], 0)], 1,
                         SamplingParams(max_new_tokens=40))


async def _batch(rollout):
    return {g.group_id: g.trajectories[0] for g in
            await asyncio.wait_for(rollout.next_batch(), WAIT_S)}


def test_an_environment_blocking_its_thread_holds_up_only_its_own_episode(release):
    async def scenario():
        episodes = _threaded_episodes({"stuck": ("block", "done"), "free": ("ok", "done")},
                                      30.0, release)
        rollout = _rollout(SafeReward(lambda text, answer: 0.0), episodes)
        _dispatch(rollout, "stuck", "free")
        first = await _batch(rollout)  # while "stuck" is blocked in its environment
        release.set()
        second = await _batch(rollout)
        episodes.host.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert list(first) == ["free"] and first["free"].reward == 1.0
    assert first["free"].result.token_ids == [10, 10, STOP, *map(ord, "ok"), 10, 10, STOP]
    assert list(second) == ["stuck"] and second["stuck"].reward == 1.0


def test_an_environment_blocking_past_its_limit_costs_its_episode_and_the_run_goes_on(release):
    async def scenario():
        episodes = _threaded_episodes({"stuck": ("block",), "free": ("done",)}, LIMIT, release)
        rollout = _rollout(SafeReward(lambda text, answer: 0.0), episodes, batch=2)
        _dispatch(rollout, "stuck", "free")
        batch = await _batch(rollout)
        episodes.host.close()
        return batch, episodes.stats.metrics()

    batch, metrics = asyncio.run(scenario())
    assert {name: t.reward for name, t in batch.items()} == {"stuck": CUTOFF, "free": 1.0}
    assert metrics["env/ended_by/timeout"] == 1 and metrics["env/errors"] == 1


def _blocking_reward(release):
    def reward(text, answer):
        return blocks(release) if answer == "block" else 0.5
    return reward


def test_a_reward_blocking_its_thread_holds_up_only_its_own_sample(release):
    async def scenario():
        reward = SafeReward(_blocking_reward(release), pool=ThreadPool(2, name="reward"))
        rollout = _rollout(reward)
        _dispatch(rollout, "slow", "fast", answer="block")
        first = await _batch(rollout)  # while "slow" is being scored
        release.set()
        second = await _batch(rollout)
        reward.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert list(first) == ["fast"] and first["fast"].reward == 0.5
    assert list(second) == ["slow"] and second["slow"].reward == 1.0


def test_a_reward_blocking_past_its_limit_scores_zero_and_the_run_goes_on(release):
    async def scenario():
        reward = SafeReward(_blocking_reward(release), timeout_s=LIMIT,
                            pool=ThreadPool(2, name="reward"))
        rollout = _rollout(reward, batch=2)
        _dispatch(rollout, "slow", "fast", answer="block")
        batch = await _batch(rollout)
        reward.close()
        return batch, reward

    batch, reward = asyncio.run(scenario())
    assert (batch["slow"].reward, batch["fast"].reward) == (0.0, 0.5)
    assert batch["slow"].reward_error.startswith("reward function took longer than "
                                          f"data.reward_timeout_s={LIMIT}s")
    assert reward.errors == 1 and reward.reasons == {"timeout": 1}

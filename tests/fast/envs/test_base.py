"""The Environment contract: tokenisation, limits, errors, ToolInfo, stats. Pure logic."""

import asyncio

import pytest

from eddyrl.envs import Action, EnvStats, Environment, EpisodeLimits, Reply
from eddyrl.errors import ConfigError
from eddyrl.protocol import ToolState


class Scripted(Environment):
    """Answers each turn with the next scripted Reply (or raises it, if an exception)."""

    def __init__(self, replies, **kwargs):
        super().__init__(prompt="p", answer="a", **kwargs)
        self.replies = list(replies)

    async def respond(self, action):
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        if reply == "hang":
            await asyncio.sleep(10)
        return reply


def step(env, text="turn", ids=(1, 2), is_last=False):
    return asyncio.run(env.step(Action(tuple(ids), text, is_last)))


def test_observation_is_the_env_tokenizing_its_own_text_only(spy):
    env = Scripted([Reply(text="<result>5</result>", tool="calc")], tokenizer=spy)
    obs = step(env, text="<calc>2+3</calc>", ids=(900, 901))
    assert obs.token_ids == tuple(ord(c) for c in "<result>5</result>")
    assert spy.encoded == ["<result>5</result>"]  # never the model's text
    assert spy.decoded == []  # never the model's tokens
    assert not obs.done and obs.reward is None and obs.ended_by is None
    assert env.observation_tokens == len(obs.token_ids)


def test_done_reply_ends_with_its_reward_and_no_tokens(spy):
    env = Scripted([Reply(text="ignored", done=True, reward=1.0)], tokenizer=spy)
    obs = step(env)
    assert (obs.done, obs.reward, obs.ended_by, obs.token_ids, obs.tool) == \
        (True, 1.0, "env", (), None)
    assert spy.encoded == []
    with pytest.raises(RuntimeError, match="ended"):
        step(env)


def test_max_turns_cuts_the_episode_with_the_cutoff_reward(spy):
    limits = EpisodeLimits(max_turns=2, cutoff_reward=-0.5)
    env = Scripted([Reply(text="r1", tool="calc"), Reply(text="r2", tool="calc")],
                   tokenizer=spy, limits=limits)
    assert not step(env).done
    obs = step(env)
    assert (obs.done, obs.ended_by, obs.reward, obs.token_ids) == (True, "max_turns", -0.5, ())
    assert obs.tool.tool == "calc"  # the tool ran; the router still learns from it


def test_last_turn_from_the_caller_ends_the_episode(spy):
    env = Scripted([Reply(text="r1", tool="calc")], tokenizer=spy)
    obs = step(env, is_last=True)
    assert (obs.done, obs.ended_by, obs.reward) == (True, "last_turn", 0.0)


def test_observation_token_budget_is_per_episode(spy):
    limits = EpisodeLimits(max_observation_tokens=5)
    env = Scripted([Reply(text="abc"), Reply(text="de"), Reply(text="f")], tokenizer=spy,
                   limits=limits)
    assert step(env).token_ids == (97, 98, 99)
    assert step(env).token_ids == (100, 101)
    obs = step(env)
    assert (obs.done, obs.ended_by, obs.token_ids) == (True, "max_observation_tokens", ())


@pytest.mark.parametrize("failure, expected", [
    (KeyError("boom"), "KeyError: 'boom'"),
    ("not a reply", "TypeError: respond() returned str, not a Reply"),
    (Reply(tool="x", status="exploded"), "ValueError: Reply.status 'exploded'"),
])
def test_environment_failures_end_the_episode_cleanly(spy, failure, expected):
    env = Scripted([failure], tokenizer=spy)
    obs = step(env)
    assert (obs.done, obs.ended_by, obs.reward) == (True, "error", 0.0)
    assert obs.error.startswith(expected)
    stats = EnvStats()
    stats.record(obs)
    assert stats.errors == 1 and stats.ended_by["error"] == 1


def test_hung_environment_is_cut_by_the_step_timeout(spy):
    env = Scripted(["hang"], tokenizer=spy, limits=EpisodeLimits(step_timeout_s=0.05))
    obs = step(env)
    assert (obs.done, obs.ended_by) == (True, "timeout")
    assert "env.step_timeout_s=0.05" in obs.error


def test_cancellation_is_not_swallowed(spy):
    async def scenario():
        env = Scripted(["hang"], tokenizer=spy)
        task = asyncio.ensure_future(env.step(Action((1,), "x")))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())


@pytest.mark.parametrize("payload, size", [(0, "small"), (1023, "small"), (1024, "medium"),
                                           (16383, "medium"), (16384, "large")])
def test_tool_info_classifies_the_payload_by_the_router_thresholds(spy, payload, size):
    env = Scripted([Reply(text="x" * payload, tool="python", status="timeout")], tokenizer=spy,
                   limits=EpisodeLimits(max_observation_tokens=20000))
    info = step(env).tool
    assert (info.tool, info.status, info.payload_bytes, info.size) == \
        ("python", "timeout", payload, size)
    assert info.state() == ToolState("python", size, "timeout")


def test_payload_counts_utf8_bytes_and_custom_thresholds(spy):
    env = Scripted([Reply(text="é" * 6, tool="t")], tokenizer=spy, payload_bytes=(10, 20))
    info = step(env).tool
    assert (info.payload_bytes, info.size) == (12, "medium")


def test_latency_is_read_from_the_given_clock(spy):
    ticks = iter([10.0, 12.5])
    env = Scripted([Reply(text="r", tool="t", status="failure", error="bad")], tokenizer=spy,
                   clock=lambda: next(ticks))
    info = step(env).tool
    assert (info.latency_s, info.status, info.error) == (2.5, "failure", "bad")


def test_one_token_stop_strings_become_ids_and_longer_ones_stay_strings(spy):
    env = Scripted([], tokenizer=spy)
    env.stop_strings = ("#", "</calc>")
    assert env.stop_conditions() == ((ord("#"),), ("</calc>",))


@pytest.mark.parametrize("key", ["max_turns", "max_observation_tokens", "step_timeout_s"])
def test_limits_name_the_bad_key(key):
    with pytest.raises(ConfigError, match=f"env.{key}"):
        EpisodeLimits(**{key: 0})


def test_stats_count_turns_tools_endings_and_errors(spy):
    env = Scripted([Reply(text="r", tool="calc"), Reply(text="r", tool="calc", status="failure"),
                    Reply(done=True, reward=1.0)], tokenizer=spy)
    stats = EnvStats()
    for _ in range(3):
        stats.record(step(env))
    metrics = stats.metrics()
    assert metrics["env/turns"] == 3 and metrics["env/episodes"] == 1
    assert metrics["env/calls/calc/success"] == 1 and metrics["env/calls/calc/failure"] == 1
    assert metrics["env/ended_by/env"] == 1 and metrics["env/errors"] == 0


def test_a_tokenizer_failure_on_the_observation_is_an_environment_error():
    class Broken:
        def encode(self, text, add_special_tokens=True):
            raise UnicodeError("cannot encode")

    obs = step(Scripted([Reply(text="r", tool="t")], tokenizer=Broken()))
    assert (obs.ended_by, obs.error) == ("error", "UnicodeError: cannot encode")

"""The episode loop with a scripted policy: the transcript is exactly the generated tokens and
the environment's tokens, with masks, log-probs and per-turn versions."""

import asyncio

import pytest

from eddyrl.envs import EnvStats, Environment, EpisodeLimits, Reply, Turn, run_episode
from eddyrl.envs.calculator import TINY_SYNTAX, CalculatorEnv
from eddyrl.envs.episode import OBSERVATION_LOGPROB, Transcript
from eddyrl.tasks.tool_task import demonstration


class ScriptedPolicy:
    """Returns scripted turns; records the transcript each turn was asked to continue."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.seen = tokenizer, list(turns), []

    async def __call__(self, transcript):
        self.seen.append(list(transcript.token_ids))
        text, version, finish = self.turns.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Turn(ids, [-0.5] * len(ids), [version] * len(ids), finish)


def episode(env, policy, decode, max_tokens=200, **kwargs):
    return asyncio.run(run_episode(env, policy, decode, max_tokens, **kwargs))


def test_tool_episode_token_in_token_out(tiny_tokenizer):
    prompt = "add 48213 90377"
    (_, call), (_, answer_text), (_, final) = demonstration(prompt)
    policy = ScriptedPolicy(tiny_tokenizer, [(call, 3, "stop"), (final + "<|im_end|>", 4, "stop")])
    env = CalculatorEnv(tokenizer=tiny_tokenizer, prompt=prompt, answer="138590",
                        syntax=TINY_SYNTAX)
    decoded, seen_obs = [], []

    def decode(ids):
        decoded.append(list(ids))
        return tiny_tokenizer.decode(ids, skip_special_tokens=True)

    stats = EnvStats()
    result = episode(env, policy, decode, stats=stats,
                     on_observation=lambda obs, n: seen_obs.append((obs.tool, n)))
    enc = lambda text: tiny_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    turn1, obs, turn2 = enc(call), enc(answer_text), enc(final + "<|im_end|>")
    t = result.transcript
    assert t.token_ids == turn1 + obs + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert t.versions == [3] * (len(turn1) + len(obs)) + [4] * len(turn2)
    assert t.logprobs == [-0.5] * len(turn1) + [OBSERVATION_LOGPROB] * len(obs) + \
        [-0.5] * len(turn2)
    assert t.turn_spans == [(0, len(turn1)), (len(turn1) + len(obs), len(t))]
    assert policy.seen == [[], turn1 + obs]  # turn 2 resumes from the exact tokens
    assert decoded == [turn1, turn2]  # each turn decoded once, for parsing only
    assert (result.reward, result.ended_by, result.final_text) == (1.0, "env", "= 138590")
    assert [info.status for info in t.tools] == ["success"]
    assert seen_obs[0] == (t.tools[0], len(turn1))
    assert stats.metrics()["env/calls/calculator/success"] == 1


class Echo(Environment):
    """A tool call every turn until told otherwise; counts close()."""

    closed = 0

    def __init__(self, **kwargs):
        super().__init__(prompt="p", answer="a", **kwargs)

    async def respond(self, action):
        if action.text.endswith("!"):
            return Reply(done=True)
        return Reply(text="ok", tool="echo")

    async def close(self):
        Echo.closed += 1


def test_turn_that_ran_out_of_tokens_is_the_last(spy):
    policy = ScriptedPolicy(spy, [("abc", 0, "length")])
    result = episode(Echo(tokenizer=spy), policy, spy.decode)
    assert (result.ended_by, result.reward) == ("last_turn", 0.0)


def test_observation_without_room_for_another_turn_ends_the_episode(spy):
    stats = EnvStats()
    policy = ScriptedPolicy(spy, [("abcdefg", 0, "stop")])
    result = episode(Echo(tokenizer=spy), policy, spy.decode, max_tokens=9, stats=stats)
    assert (result.ended_by, result.reward) == ("max_tokens", 0.0)
    assert len(result.transcript) == 7  # the observation was not appended
    assert stats.ended_by["max_tokens"] == 1


def test_caller_scores_when_the_environment_gives_no_reward(spy):
    policy = ScriptedPolicy(spy, [("call", 0, "stop"), ("done!", 1, "stop")])
    result = episode(Echo(tokenizer=spy), policy, spy.decode)
    assert (result.reward, result.ended_by, result.final_text) == (None, "env", "done!")


def test_max_turns_through_the_loop(spy):
    policy = ScriptedPolicy(spy, [("a", 0, "stop"), ("b", 0, "stop")])
    result = episode(Echo(tokenizer=spy, limits=EpisodeLimits(max_turns=2)), policy,
                     spy.decode)
    assert result.ended_by == "max_turns" and result.transcript.token_ids == [97, 111, 107, 98]


def test_environment_is_closed_even_when_generation_fails(spy):
    async def broken(transcript):
        raise RuntimeError("worker died")

    before = Echo.closed
    with pytest.raises(RuntimeError, match="worker died"):
        episode(Echo(tokenizer=spy), broken, spy.decode)
    assert Echo.closed == before + 1


def test_a_failing_close_is_counted_not_raised(spy):
    class LeakyEcho(Echo):
        async def close(self):
            raise OSError("sandbox gone")

    stats = EnvStats()
    result = episode(LeakyEcho(tokenizer=spy), ScriptedPolicy(spy, [("x!", 0, "stop")]),
                     spy.decode, stats=stats)
    assert result.ended_by == "env" and stats.errors == 1
    assert stats.last_errors == ["close: OSError: sandbox gone"]


def test_turn_lengths_must_agree():
    with pytest.raises(ValueError, match="2 tokens has 1 log-probs"):
        Transcript().add_turn(Turn([1, 2], [0.0], [0, 0], "stop"))


def test_episode_state_is_the_loop_without_io(spy):
    """What the streaming rollout does with engine results: act, step, observe."""
    from eddyrl.envs import EpisodeState, Observation

    state = EpisodeState(spy.decode, max_tokens=50)
    action = state.act(Turn([104, 105], [-1.0, -2.0], [7, 7], "stop"))
    assert (action.token_ids, action.text, action.is_last) == ((104, 105), "hi", False)
    assert state.observe(Observation(token_ids=(1, 2, 3))) is None
    assert state.transcript.token_ids == [104, 105, 1, 2, 3]
    assert state.transcript.versions == [7] * 5
    state.act(Turn([33], [-0.1], [8], "stop"))
    episode = state.observe(Observation(done=True, reward=0.5, ended_by="env"))
    assert (episode.reward, episode.final_text, episode.transcript.loss_mask) == \
        (0.5, "!", [1, 1, 0, 0, 0, 1])

"""Multi-turn episodes through the streaming rollout on real `hf` engines and the tiny model.

The random tiny model writes nothing meaningful, so its turns are ended by stop tokens that it
samples often (the ten digits: a turn is ~5 tokens) and a scripted environment decides what
each turn gets back. What is checked is the runtime's side: the training row is exactly
prompt + turn 1 + observation 1 + turn 2 ..., the behaviour log-probs of every generated token
are the engine's (a single forward pass over the row reproduces them), environment tokens are
masked, versions are kept per turn, tool failures and timeouts do not lose the episode,
environment errors are counted and the run goes on, and aborts, migrations and restarts in the
middle of an episode keep (or, for a restart, rebuild) the transcript.
"""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fake_runtime import RecordingRuntime

from eddyrl.core.requests import Status
from eddyrl.core.batching import build_train_batch
from eddyrl.core.config import AlgorithmConfig, LoopConfig
from eddyrl.build import build_controller
from eddyrl.core.controller import LoopSettings
from eddyrl.core.episodes import Episodes
from eddyrl.core.ledger import Ledger, State
from eddyrl.core.version_assignment import VersionAssignment
from eddyrl.core.rewarding import SafeReward
from eddyrl.core.rollout import StreamingRollout
from eddyrl.protocol import Group, SamplingParams
from eddyrl.core.version_window import VersionWindow
from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.envs import Environment, EpisodeLimits, Reply
from eddyrl.envs.loading import EnvironmentFactory
from eddyrl.hal import get_platform
from eddyrl.runtime.inprocess import InProcessRuntime
from eddyrl.tasks.prompts import PromptSet

OBSERVATION = "result:12\n"
GATE: asyncio.Event | None = None  # "wait" turns hold here until the test opens it


class Scripted(Environment):
    """Turn k gets `script[k]` (the last entry repeats): "ok" a successful tool result,
    "failure" / "timeout" a failed or timed-out tool, "hang" never answers, "raise" a bug in
    the environment, "wait" a result once GATE opens, "done" the end with reward 1."""

    closed = 0

    def __init__(self, *, script=("ok", "ok", "done"), **base):
        super().__init__(**base)
        self.script = script

    async def respond(self, action):
        what = self.script[min(self.turns, len(self.script)) - 1]
        if what == "done":
            return Reply(done=True, reward=1.0)
        if what == "hang":
            await asyncio.sleep(60)
        if what == "raise":
            raise RuntimeError(f"environment bug on {self.prompt!r}")
        if what == "wait":
            await GATE.wait()
        status = what if what in ("failure", "timeout") else "success"
        return Reply(text=OBSERVATION, tool="calc", status=status)

    async def close(self):
        Scripted.closed += 1


def _factory(tokenizer, limits=EpisodeLimits(max_turns=8), **options):
    return EnvironmentFactory(Scripted, "Scripted",
                              dict(tokenizer=tokenizer, limits=limits, **options))


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _engines(tiny_model_dir, count, partial=False):
    return [HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=s,
                              partial_rollout=partial) for s in range(count)]


def _sampling(tokenizer, max_new_tokens=80, stops="0123456789"):
    ids = tuple(tokenizer.convert_tokens_to_ids(list(stops))) + (tokenizer.eos_token_id,)
    return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=ids)


def _rollout(runtime, tokenizer, factory, *, k=0, partial=False):
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ledger = Ledger()
    window = VersionWindow(max_staleness=k, batch_groups=1, max_concurrent=8)
    rollout = StreamingRollout(runtime, window, VersionAssignment(len(runtime.workers), 64),
                               ledger, SafeReward(lambda text, answer: 0.5), decode,
                               partial_rollout=partial, episodes=Episodes(factory, decode))
    return rollout, ledger


def _group(ledger, tokenizer, name="a"):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "add 1 2"}],
                                        add_generation_prompt=True, return_dict=False)
    ledger.queue(name, 0, 0)
    return Group(name, "add 1 2", "3", list(ids), 0)


def _spans(mask, value):
    """[start, end) runs of `value` in `mask`."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _check_row(result, tokenizer, observations):
    """The row is turns separated by exactly the environment's tokens, masked."""
    obs = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    env_spans = _spans(result.loss_mask, 0)
    assert len(env_spans) == observations
    assert len(_spans(result.loss_mask, 1)) == observations + 1  # a turn around each
    for start, end in env_spans:
        assert result.token_ids[start:end] == obs
        assert result.logprobs[start:end] == [0.0] * len(obs)
    assert len(result.token_ids) == len(result.logprobs) == len(result.versions) == \
        len(result.loss_mask)


def _max_logprob_error(model_dir, groups, pad_id):
    """|engine log-prob - one forward pass over the training row|, on trained tokens."""
    batch = build_train_batch(groups, pad_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:].bool()
    assert int(mask.sum()) == sum(t.num_generated for g in groups for t in g.trajectories)
    return (logp - batch.old_logprobs[:, 1:])[mask].abs().max().item()


def test_episode_rows_are_prompt_turns_and_observations_with_the_engines_logprobs(
        tiny_model_dir, tokenizer):
    runtime = InProcessRuntime(_engines(tiny_model_dir, 1))
    rollout, ledger = _rollout(runtime, tokenizer, _factory(tokenizer))
    Scripted.closed = 0

    async def scenario():
        rollout.dispatch([_group(ledger, tokenizer)], 4, _sampling(tokenizer))
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert [t.reward for t in group.trajectories] == [1.0] * 4  # the environment's reward
    for t in group.trajectories:
        _check_row(t.result, tokenizer, observations=2)
        assert set(t.result.versions) == {0}
    assert _max_logprob_error(tiny_model_dir, [group], tokenizer.pad_token_id) < 1e-4
    batch = build_train_batch([group], tokenizer.pad_token_id)
    row = batch.loss_mask[0, len(group.prompt_ids):].tolist()
    assert row[:len(group.trajectories[0].result.loss_mask)] == \
        group.trajectories[0].result.loss_mask
    stats = rollout.episodes.stats.metrics()
    assert (stats["env/turns"], stats["env/episodes"], stats["env/calls/calc/success"]) == \
        (12, 4, 8)
    assert Scripted.closed == 4  # every environment closed once
    assert rollout.assignment.pending == [{}] and ledger.state("a") == State.COLLECTED
    assert runtime.workers[0].stats().running == 0


async def _publish_between_turns(runtime, rollout, ledger, tokenizer):
    """Dispatch one group of two episodes, wait until both wait for their environment (the
    `GATE`), publish version 1 (the same weights) to the only worker, open the gate, and
    return the batch; returns (engine version right after publishing, batch)."""
    global GATE
    GATE = asyncio.Event()
    rollout.dispatch([_group(ledger, tokenizer)], 2, _sampling(tokenizer))
    while not all(r.status is Status.BETWEEN_TURNS for r in rollout.table):
        await asyncio.sleep(0.005)
    engine = runtime.workers[0]
    await engine.load_weights(1, [dict(engine.model.state_dict())])  # same weights
    rollout.window.advance()
    rollout.published(1, [engine.version])
    published = engine.version
    GATE.set()
    return published, await rollout.next_batch()


def test_each_turn_keeps_the_version_that_generated_it(tiny_model_dir, tokenizer):
    """Partial rollout: new weights published while the environment works reach the next turn;
    the observation carries the version of the turn it answers."""
    runtime = InProcessRuntime(_engines(tiny_model_dir, 1, partial=True))
    factory = _factory(tokenizer, script=("wait", "done"))
    rollout, ledger = _rollout(runtime, tokenizer, factory, k=1, partial=True)

    async def scenario():
        _, batch = await _publish_between_turns(runtime, rollout, ledger, tokenizer)
        return batch

    (group,) = asyncio.run(scenario())
    for t in group.trajectories:
        _check_row(t.result, tokenizer, observations=1)
        _, (second, end) = _spans(t.result.loss_mask, 1)
        ((_, obs_end),) = _spans(t.result.loss_mask, 0)
        assert set(t.result.versions[:obs_end]) == {0}  # turn 1 and its observation
        assert set(t.result.versions[second:end]) == {1}  # turn 2 ran on the new weights
    assert _max_logprob_error(tiny_model_dir, [group], tokenizer.pad_token_id) < 1e-4


def test_an_episode_whose_version_is_gone_restarts_in_a_fresh_environment(tiny_model_dir,
                                                                          tokenizer):
    """Without partial rollout an idle engine takes new weights at once; the episode that was
    between turns cannot finish on them (C1), so it starts over on the latest version, in a
    new environment (the old one closed)."""
    runtime = InProcessRuntime(_engines(tiny_model_dir, 1))
    rollout, ledger = _rollout(runtime, tokenizer, _factory(tokenizer, script=("wait", "done")),
                               k=1)
    Scripted.closed = 0

    async def scenario():
        published, batch = await _publish_between_turns(runtime, rollout, ledger, tokenizer)
        assert published == 1  # idle: applied at once
        return batch

    (group,) = asyncio.run(scenario())
    assert rollout.restarted == 2
    for t in group.trajectories:
        _check_row(t.result, tokenizer, observations=1)
        assert set(t.result.versions) == {1}  # C1: the whole episode on one version
    assert Scripted.closed == 4 and rollout.assignment.pending == [{}]


@pytest.mark.parametrize("script, limits, ended_by, observations, reward", [
    (("failure", "timeout", "done"), EpisodeLimits(), "env", 2, 1.0),
    (("ok", "hang"), EpisodeLimits(step_timeout_s=0.05, cutoff_reward=-1.0), "timeout", 1, -1.0),
])
def test_tool_failures_and_timeouts_keep_the_episode(tiny_model_dir, tokenizer, script,
                                                     limits, ended_by, observations, reward):
    """A failed or timed-out tool call is an observation like any other; an environment that
    does not answer within env.step_timeout_s ends its episode with the cutoff reward. Either
    way the sample is collected whole and counted."""
    runtime = InProcessRuntime(_engines(tiny_model_dir, 1))
    factory = _factory(tokenizer, limits=limits, script=script)
    rollout, ledger = _rollout(runtime, tokenizer, factory)

    async def scenario():
        rollout.dispatch([_group(ledger, tokenizer)], 3, _sampling(tokenizer))
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert [t.reward for t in group.trajectories] == [reward] * 3
    for t in group.trajectories:
        _check_row(t.result, tokenizer, observations)
    stats = rollout.episodes.stats.metrics()
    assert stats[f"env/ended_by/{ended_by}"] == 3
    if ended_by == "env":
        assert stats["env/calls/calc/failure"] == stats["env/calls/calc/timeout"] == 3
    else:
        assert stats["env/errors"] == 3 and "step_timeout_s" in \
            rollout.episodes.stats.last_errors[-1]


def test_a_migration_in_the_middle_of_an_episode_keeps_its_transcript(tiny_model_dir,
                                                                      tokenizer):
    """Worker 0 is lent to training while its episodes are in their second or later turn:
    running turns are aborted and resumed on worker 1 with the transcript and the partial
    turn, episodes between turns simply take their next turn there. Nothing is lost and the
    log-probs still match one forward pass (both engines hold the same weights)."""
    runtime = InProcessRuntime(_engines(tiny_model_dir, 2))
    factory = _factory(tokenizer, script=("ok", "ok", "ok", "done"))
    rollout, ledger = _rollout(runtime, tokenizer, factory)
    sampling = _sampling(tokenizer, max_new_tokens=150, stops="0123")  # ~13-token turns

    async def scenario():
        rollout.dispatch([_group(ledger, tokenizer)], 4, sampling, worker=0)
        while not any(len(r.episode.state.transcript) and r.status is not Status.BETWEEN_TURNS
                      for r in rollout.table):
            await asyncio.sleep(0.002)
        assert await rollout.lend(0) == 0  # every request moved off worker 0
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert rollout.migrated == 4
    assert runtime.workers[1].stats().tokens_generated > 0
    finished = [t for t in group.trajectories if t.reward == 1.0]  # not cut by the budget
    assert len(finished) >= 3
    for t in finished:
        _check_row(t.result, tokenizer, observations=3)
    assert _max_logprob_error(tiny_model_dir, [group], tokenizer.pad_token_id) < 1e-4
    assert rollout.assignment.pending == [{}, {}] and ledger.state("a") == State.COLLECTED


class LateAborts(InProcessRuntime):
    """Aborts reach the engines late, as over a network: when the test lets them through."""

    def __init__(self, engines):
        super().__init__(engines)
        self.deliver = asyncio.Event()

    async def abort(self, worker, request_ids):
        await self.deliver.wait()
        await super().abort(worker, request_ids)


def test_moves_between_turns_and_a_late_abort_keep_the_episode(tiny_model_dir, tokenizer):
    """Worker 0 is lent while an episode's first turn runs there, but the abort arrives after
    the turn ended: the turn counts, the environment answers, and the episode (now between
    turns) is moved back to worker 0 without an abort. The engine still holds the late abort
    and applies it to the resumed turn; the rollout recognises it and resumes again."""
    runtime = LateAborts(_engines(tiny_model_dir, 2))
    rollout, ledger = _rollout(runtime, tokenizer, _factory(tokenizer, script=("wait", "done")))

    async def scenario():
        global GATE
        GATE = asyncio.Event()
        runtime.deliver = asyncio.Event()
        rollout.dispatch([_group(ledger, tokenizer)], 1, _sampling(tokenizer), worker=0)
        (request,) = list(rollout.table)
        while not runtime.workers[0].stats().tokens_generated:
            await asyncio.sleep(0.001)
        lending = asyncio.ensure_future(rollout.lend(0))
        while request.status is not Status.BETWEEN_TURNS:  # the turn ended before the abort arrived
            await asyncio.sleep(0.001)
        runtime.deliver.set()
        await lending
        assert request.worker == 1 and request.source is None
        rollout.take_back(0, 0)
        await rollout.lend(1)  # between turns: moved at once, nothing to abort
        assert request.worker == 0 and rollout.running_on(1) == 0
        GATE.set()
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    (t,) = group.trajectories
    _check_row(t.result, tokenizer, observations=1)
    assert t.reward == 1.0 and rollout.migrated == 1
    assert runtime.workers[1].stats().tokens_generated == 0  # both turns ran on worker 0
    assert rollout.assignment.pending == [{}, {}] and not len(rollout.table)


def test_tool_returns_reach_the_bucket_router(tiny_model_dir, tokenizer):
    """Libra learns from tool returns: each observation's ToolState is reported at the
    transcript length it came after, and the router's books end empty."""
    from eddyrl.scheduler.buckets import (BucketRouter, BucketSpec, RoutingConfig, ToolState,
                                          bucket_instances)

    runtime = InProcessRuntime(_engines(tiny_model_dir, 2))
    rollout, ledger = _rollout(runtime, tokenizer, _factory(tokenizer))
    config = RoutingConfig(policy="bucket", milestones=[1000], min_observations=1, window=10,
                           rebuild_every=1,
                           buckets=[BucketSpec("short", 10), BucketSpec("long", 400)])
    rollout.use_router(BucketRouter(config, bucket_instances(config)))
    seen = []
    on_state = rollout.router.on_state
    rollout.router.on_state = lambda rid, state, tokens, allowed: (
        seen.append((rid, state, tokens)), on_state(rid, state, tokens, allowed))[1]

    async def scenario():
        rollout.dispatch([_group(ledger, tokenizer)], 2, _sampling(tokenizer))
        return await rollout.next_batch()

    (group,) = asyncio.run(scenario())
    assert [s for _, s, _ in seen] == [ToolState("calc", "small", "success")] * 4
    for t in group.trajectories:
        ends = [end for _, end in _spans(t.result.loss_mask, 1)][:2]
        assert [n for rid, _, n in seen if rid == t.result.request_id] == ends
    assert rollout.router.stats().connections == {"short": 0, "long": 0}


def _broken(*, prompt, answer, **kwargs):
    """Prompts with answer 6: the environment cannot even be built; answer 4: it raises."""
    if answer == "6":
        raise OSError("sandbox unavailable")
    script = ("raise",) if answer == "4" else ("ok", "done")
    return Scripted(prompt=prompt, answer=answer, script=script, **kwargs)


def test_environment_errors_are_counted_and_the_run_trains_every_prompt_once(tiny_model_dir,
                                                                             tokenizer):
    rows = [{"prompt": f"add {i} {i}", "answer": str(2 * i)} for i in range(6)]
    prompts = PromptSet.from_rows(rows, "rows", tokenizer, 64, "error")
    runtime = RecordingRuntime(_engines(tiny_model_dir, 1)[0])
    settings = LoopSettings(
        loop=LoopConfig(steps=3, batch_prompts=2, eval_every=0),
        algorithm=AlgorithmConfig(dynamic_sampling=False), sampling=_sampling(tokenizer),
        n_samples=3, seed=0, pad_id=tokenizer.pad_token_id,
        env=EnvironmentFactory(_broken, "broken", dict(tokenizer=tokenizer,
                                                        limits=EpisodeLimits())))
    controller = build_controller(settings, runtime, prompts, prompts,
                            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                            reward=SafeReward(lambda text, answer: 0.0))
    summary = asyncio.run(controller.run())
    assert summary["steps"] == 3
    assert controller.ledger.check_exactly_once(range(6), epoch=0).ok
    steps = controller.history[1:]
    assert sum(m["env/errors"] for m in steps) == 6  # prompts 2 and 3, three samples each
    assert sum(m["env/calls/calc/success"] for m in steps) == 12
    env = summary["env"]
    assert env["errors"] == 6 and env["ended_by/error"] == 6 and env["ended_by/env"] == 12
    assert {e.split(":")[0] for e in env["last_errors"]} <= {"OSError", "RuntimeError"}
    assert env["eval"]["episodes"] == 2 * len(rows)  # before and after training
    for m, batch in zip(steps, runtime.batches):  # observations count as neither
        assert batch.num_tokens() == m["gen_tokens"] < m["response_len_mean"] * 6

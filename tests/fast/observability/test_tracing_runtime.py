"""TracingRuntime around a fake runtime on a hand-moved clock: each worker's spans have the
right names on the right role's tracks, never overlap, and a trace round-trips through JSON."""

import asyncio
import json

import pytest

from eddyrl.core.rewarding import SafeReward
from eddyrl.observability.report import idle_by_role
from eddyrl.observability.trace import Trace
from eddyrl.observability.tracing import TracingRuntime
from eddyrl.runtime_protocol import Recoverable

ROLLOUT, TRAIN, DRIVER = Trace.ROLES["rollout"], Trace.ROLES["train"], Trace.ROLES["driver"]


class FakeRuntime:
    """Every call moves the clock by a fixed amount: the spans' bounds are exact."""

    def __init__(self) -> None:
        self.t = 0.0
        self.workers = [object(), object()]
        self.stats_calls = 0

    def now(self) -> float:
        return self.t

    async def generate(self, worker, requests):
        for request in requests:
            self.t += 1.0
            await asyncio.sleep(0)
            yield request

    async def train(self, batch, replicas=()):
        self.t += 2.0
        return {"loss": 0.0, "replicas": replicas}

    async def sync_weights(self, version, hold=()):
        self.t += 0.5
        return [-1 if worker in hold else version for worker in range(2)]

    async def abort(self, worker, request_ids):
        self.t += 0.1

    async def join_training(self, worker):
        self.t += 0.25

    async def leave_training(self, worker):
        self.t += 0.25
        return 3

    async def replica_version(self, worker):
        return 3

    async def worker_stats(self):
        self.stats_calls += 1
        return []


class Replacing(FakeRuntime):
    replacements = 0

    async def replace_worker(self, worker):
        self.t += 3.0
        return 7


def spans(trace, pid, tid):
    return [(e["name"], round(e["ts"] / 1e6, 6), round((e["ts"] + e["dur"]) / 1e6, 6))
            for e in trace.events if (e["pid"], e["tid"]) == (pid, tid)]


def scenario(tracer: TracingRuntime, fake: FakeRuntime):
    async def run():
        async for _ in tracer.generate(0, ["a", "b"]):  # [0, 2] on rollout 0
            pass
        assert (await tracer.train("batch"))["replicas"] == ()  # [2, 4] on both ranks
        # [4, 4.5] everywhere; arguments the wrapper does not know pass through
        assert await tracer.sync_weights(1, hold=[1]) == [1, -1]
        first = tracer.generate(1, ["c", "d", "e"])
        await first.__anext__()  # worker 1 generating from 4.5; t = 5.5
        second = tracer.generate(1, ["f"])  # a second call while the first streams
        await second.__anext__()  # t = 6.5
        await tracer.abort(1, ["c"])  # [6.5, 6.6]: drawn over the generation
        async for _ in second:  # ends at once: the first call still streams
            pass
        async for _ in first:  # t = 8.6
            pass
        reward = tracer.timed_reward(SafeReward(lambda response, answer: clock(0.25)))
        assert reward("x", "y") == (0.25, None) and reward("x", "z") == (0.25, None)
        await tracer.join_training(0)  # [8.6+0.5, 9.35] after the rewards
        await tracer.train("batch", [0])  # [9.35, 11.35]: ranks train, worker 0 a replica
        assert await tracer.leave_training(0) == 3  # [11.35, 11.6]
        await tracer.worker_stats()  # passed through, not drawn
        last = tracer.generate(0, ["g"])
        await last.__anext__()  # from 11.6; asyncio.run closes the stream at 12.6

    def clock(value):
        fake.t += 0.25
        return value

    return asyncio.run(run())


def test_spans_per_role_with_names_and_exact_bounds():
    fake = FakeRuntime()
    trace = Trace()
    tracer = TracingRuntime(fake, trace, trainer_ranks=2, origin=0.0)
    scenario(tracer, fake)
    tracer.close()
    assert trace.duration_s == pytest.approx(12.6)
    assert spans(trace, ROLLOUT, 0) == [
        ("generate", 0, 2), ("weight sync", 4, 4.5), ("join", 9.1, 9.35),
        ("replica", 9.35, 11.35), ("leave", 11.35, 11.6), ("generate", 11.6, 12.6)]
    assert spans(trace, ROLLOUT, 1) == [
        ("weight sync", 4, 4.5), ("generate", 4.5, 6.5), ("migrate", 6.5, 6.6),
        ("generate", 6.6, 8.6)]
    for rank in (0, 1):
        assert spans(trace, TRAIN, rank) == [("train", 2, 4), ("weight sync", 4, 4.5),
                                             ("train", 9.35, 11.35)]
    # the two reward calls came back to back: one span, counted
    assert spans(trace, DRIVER, 0) == [("reward", 8.6, 9.1)]
    assert [e["args"] for e in trace.events if e["pid"] == DRIVER] == \
        [{"calls": 2, "busy_s": pytest.approx(0.5)}]
    assert fake.stats_calls == 1


def test_held_out_evaluation_is_its_own_span():
    """The start-up evaluation and step 1's generation were one "generate" span (issue 20)."""
    from eddyrl.protocol import GenerationRequest, SamplingParams

    fake = FakeRuntime()
    trace = Trace()
    tracer = TracingRuntime(fake, trace, origin=0.0)

    async def run():
        sampling = SamplingParams(max_new_tokens=4)
        for purpose in ("eval", "train"):
            async for _ in tracer.generate(0, [GenerationRequest(purpose, [1], sampling,
                                                                 purpose=purpose)]):
                pass

    asyncio.run(run())
    tracer.close()
    assert spans(trace, ROLLOUT, 0) == [("evaluate", 0, 1), ("generate", 1, 2)]


def test_close_ends_what_is_still_under_way():
    fake = FakeRuntime()
    trace = Trace()
    tracer = TracingRuntime(fake, trace, origin=0.0)

    async def stuck():
        fake.t = 1.0
        await tracer.sync_weights(1)  # [1, 1.5]
        stream = tracer.generate(0, ["a", "b"])
        await stream.__anext__()  # from 1.5; t = 2.5, the stream not finished
        fake.t = 4.0
        tracer.close()  # the run ends with it open

    asyncio.run(stuck())
    assert spans(trace, ROLLOUT, 0) == [("weight sync", 1, 1.5), ("generate", 1.5, 4.0)]
    assert trace.duration_s == 4.0


def test_a_workers_spans_never_overlap():
    fake = FakeRuntime()
    trace = Trace()
    tracer = TracingRuntime(fake, trace, origin=0.0)
    scenario(tracer, fake)
    tracer.close()
    for track in {(e["pid"], e["tid"]) for e in trace.events}:
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace.events
                      if (e["pid"], e["tid"]) == track)
        assert all(end <= start + 1e-6 for (_, end), (start, _) in zip(mine, mine[1:]))
        assert all(end >= start for start, end in mine)


def test_replace_worker_is_traced_only_where_the_runtime_has_it():
    plain = TracingRuntime(FakeRuntime(), Trace(), origin=0.0)
    # the wrapper has the capabilities of what it wraps: a runtime that cannot replace
    # workers says so
    assert not isinstance(plain, Recoverable) and getattr(plain, "replace_worker", None) is None
    assert isinstance(TracingRuntime(Replacing(), Trace(), origin=0.0), Recoverable)
    fake = Replacing()
    trace = Trace()
    tracer = TracingRuntime(fake, trace, origin=0.0)
    assert asyncio.run(tracer.replace_worker(1)) == 7
    assert spans(trace, ROLLOUT, 1) == [("replace", 0, 3)]
    assert tracer.workers is fake.workers  # everything else passes through


def test_trace_round_trips_and_gives_idle_ratios(tmp_path):
    fake = FakeRuntime()
    trace = Trace()
    tracer = TracingRuntime(fake, trace, trainer_ranks=1, origin=0.0)
    scenario(tracer, fake)
    tracer.close().write(str(tmp_path / "trace.json"))
    raw = json.loads((tmp_path / "trace.json").read_text())
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in raw["traceEvents"]
             if e["ph"] == "M"}
    assert names[(TRAIN, 0)] == "trainer rank 0" and names[(ROLLOUT, 1)] == "rollout worker 1"
    assert names[(ROLLOUT, None)] == "rollout"
    loaded = Trace.load(str(tmp_path / "trace.json"))
    assert loaded.events == trace.events and loaded.threads == trace.threads
    assert loaded.duration_s == pytest.approx(12.6)
    idle = idle_by_role(loaded)
    assert set(idle) == {"rollout", "train"}  # the driver is no accelerator
    # trainer: train 2 + 2, sync 0.5 of 12.6 s
    assert idle["train"]["idle_ratio"] == pytest.approx(1 - 4.5 / 12.6)
    busy = (2 + 0.5 + 0.25 + 2 + 0.25 + 1) + (0.5 + 2 + 0.1 + 2)
    assert idle["rollout"]["idle_ratio"] == pytest.approx(1 - busy / (2 * 12.6))
    assert idle["rollout"]["workers"]["rollout worker 1"]["migrate"] == pytest.approx(0.1)


def test_reward_bursts_are_one_span_that_keeps_the_time_spent():
    fake = FakeRuntime()
    trace = Trace()
    tracer = TracingRuntime(fake, trace, origin=0.0)

    def score(response, answer):
        fake.t += 0.001
        return 1.0

    reward = tracer.timed_reward(SafeReward(score))
    for gap in (0.0, 0.005, 0.005, 0.1):  # three calls within 10 ms of each other, then one
        fake.t += gap
        reward("r", "a")
    assert spans(trace, DRIVER, 0) == [("reward", 0, 0.013), ("reward", 0.113, 0.114)]
    assert [e["args"]["calls"] for e in trace.events] == [3, 1]
    busy = trace.busy_seconds()[(DRIVER, 0)]["reward"]
    assert busy == pytest.approx(0.004)  # the calls' own time, not the bursts' length

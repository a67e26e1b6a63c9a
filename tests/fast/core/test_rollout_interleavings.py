"""Scripted interleavings of the streaming rollout: the test decides, result by result, what
each worker's engine answers and when, so the race behind issue 18's CI failure and every kind
of bad engine output are reproduced exactly, not by chance.

The CI failure: a request being moved (its abort on the way to the source) was refused by the
source, whose engine had taken new weights; the restart took it off the source while the book
already had it on the target ("worker 1 has 0 running requests of version 1, not 1")."""

import asyncio

import pytest

from eddyrl.core.ledger import Ledger
from eddyrl.core.requests import Status
from eddyrl.core.rewarding import SafeReward
from eddyrl.core.rollout import StreamingRollout
from eddyrl.core.version_assignment import VersionAssignment
from eddyrl.core.version_window import VersionWindow
from eddyrl.errors import WorkerLost
from eddyrl.protocol import EngineStats, GenerationResult, Group, SamplingParams


class ManualRuntime:
    """Generation calls that yield exactly what the test `emit`s for them, in that order."""

    def __init__(self, workers: int) -> None:
        self.workers = [None] * workers
        self.calls: list[tuple[int, list]] = []  # (worker, requests) per generate call
        self.aborts: list[tuple[int, list[str]]] = []
        self._queues: dict[int, asyncio.Queue] = {}

    async def generate(self, worker, requests):
        call = len(self.calls)
        self.calls.append((worker, requests))
        queue = self._queues.setdefault(call, asyncio.Queue())
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def emit(self, call: int, *items) -> None:
        queue = self._queues.setdefault(call, asyncio.Queue())
        for item in items:
            queue.put_nowait(item)

    async def abort(self, worker, request_ids):
        self.aborts.append((worker, list(request_ids)))

    async def worker_stats(self):
        return [EngineStats(0, 0, 0, 0, 0.0) for _ in self.workers]


def _result(request, reason="stop", tokens=(5, 2), version=0):
    return GenerationResult(request.request_id, list(request.prompt_ids), list(tokens),
                            [-1.0] * len(tokens), [version] * len(tokens), reason)


class NeverBack:
    """A recovery whose replacement never comes back (the test ends first)."""

    async def replace_worker(self, worker):
        await asyncio.Event().wait()


def _rollout(workers=2):
    runtime = ManualRuntime(workers)
    window = VersionWindow(max_staleness=1, batch_groups=1, max_concurrent=8)
    rollout = StreamingRollout(runtime, window, VersionAssignment(workers, 8), Ledger(),
                               SafeReward(lambda text, answer: 1.0), lambda ids: "x",
                               recovery=NeverBack())
    return runtime, rollout


def _dispatch(rollout, name, worker, n=1):
    rollout.ledger.queue(name, len(rollout.ledger.counts()), 0)
    rollout.dispatch([Group(name, name, "1", [7], 0)], n, SamplingParams(max_new_tokens=8),
                     worker=worker)


async def _turns(n=10):
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_moving_request_refused_by_its_source_restarts_once_on_the_latest_version():
    async def scenario():
        runtime, rollout = _rollout()
        _dispatch(rollout, "a", worker=1)
        _dispatch(rollout, "b", worker=0)
        await _turns()
        rollout.published(1, [0, 0])  # both busy: version 1 only staged
        assert await rollout.lend(1) == 0  # evacuated: a-0 moves to worker 0 (hosts 0)
        (request,) = [r for r in rollout.table if r.id == "a-0"]
        assert request.status is Status.MOVING and (request.source, request.worker) == (1, 0)
        # the race: worker 1's engine refuses a-0 before the abort lands (it took version 1)
        (a_call,) = [i for i, (w, _) in enumerate(runtime.calls) if w == 1]
        runtime.emit(a_call, _result(runtime.calls[a_call][1][0], "refused", tokens=()), None)
        await _turns()
        rollout.table.check()
        assert request.status is Status.RUNNING and request.worker == 0
        assert request.version == 1 and request.stale_aborts == {1}
        assert rollout.restarted == 1 and rollout.assignment.pending[1] == {}
        # the restart went out once, to worker 0, from scratch, and finishes the group
        (restart,) = [i for i, (w, reqs) in enumerate(runtime.calls)
                      if w == 0 and reqs[0].request_id == "a-0"]
        assert runtime.calls[restart][1][0].resume_ids == []
        runtime.emit(restart, _result(runtime.calls[restart][1][0], version=1), None)
        await _turns()
        assert rollout.ledger.state("a").value == "collected"
        rollout.table.check()

    asyncio.run(scenario())


@pytest.mark.parametrize("fault", ["duplicate_final", "progress_after_final",
                                   "unknown_request"])
def test_bad_engine_output_is_counted_and_ignored_with_one_warning(fault, caplog):
    async def scenario():
        runtime, rollout = _rollout(workers=1)
        _dispatch(rollout, "a", worker=0)
        await _turns()
        (request,) = runtime.calls[0][1]
        final = _result(request)
        bad = {"duplicate_final": final,
               "progress_after_final": GenerationResult(request.request_id, [7], [5], [-1.0],
                                                        [0], "progress"),
               "unknown_request": GenerationResult("zz-9", [7], [5], [-1.0], [0], "stop")}
        runtime.emit(0, final, bad[fault], None)
        await _turns()
        assert rollout.stray == {fault: 1}
        assert rollout.ledger.state("a").value == "collected"
        assert len(rollout.store.take_groups("trainer", ["a"], ["response", "reward"])) == 1
        rollout.table.check()

    with caplog.at_level("WARNING", logger="eddyrl.rollout"):
        asyncio.run(scenario())
    (warning,) = [r for r in caplog.records if "ignored a result" in r.getMessage()]
    assert "worker 0" in warning.getMessage() and ("a-0" in warning.getMessage()
                                                   or "zz-9" in warning.getMessage())


def test_a_lost_workers_requests_run_elsewhere_from_scratch():
    async def scenario():
        runtime, rollout = _rollout()
        _dispatch(rollout, "a", worker=0, n=2)
        await _turns()
        runtime.emit(0, WorkerLost(0, "generate", "killed"))
        await _turns()
        assert rollout.regenerated == 2 and rollout.assignment.available == [False, True]
        regenerated = [i for i, (w, _) in enumerate(runtime.calls) if w == 1]
        assert regenerated and all(r.request_id.startswith("a-")
                                   for i in regenerated for r in runtime.calls[i][1])
        rollout.table.check()

    asyncio.run(scenario())


def test_a_stream_from_an_old_incarnation_is_counted_as_stray():
    async def scenario():
        runtime, rollout = _rollout()
        _dispatch(rollout, "a", worker=0)
        _dispatch(rollout, "b", worker=0)
        await _turns()
        calls = [i for i, (w, _) in enumerate(runtime.calls) if w == 0]
        rollout.streams.incarnation[0] += 1  # as `worker_lost` does, for this test alone
        runtime.emit(calls[0], _result(runtime.calls[calls[0]][1][0]))
        await _turns()
        assert rollout.stray == {"old_incarnation": 1}
        assert rollout.ledger.state("a").value == "generating"

    asyncio.run(scenario())



def test_evaluation_and_training_requests_go_to_an_engine_in_separate_calls():
    """A worker's batched sends are split per purpose as well as per version, so a trace can
    draw the held-out evaluation as its own span (issue 20: it was merged into step 1's
    generation)."""
    from eddyrl.core.requests import Purpose, Request
    from eddyrl.core.streams import Streams

    runtime = ManualRuntime(1)
    streams = Streams(runtime, on_result=lambda w, r: None, on_lost=lambda w, e: None)

    async def scenario():
        group, sampling = Group("g", "p", "1", [7], 0), SamplingParams(max_new_tokens=8)
        for name, evaluation in (("t0", False), ("e0", True), ("t1", False)):
            purpose = Purpose.EVAL if evaluation else Purpose.TRAIN
            request = Request(name, group, 0, sampling, purpose, 0)
            request.worker = 0
            streams.send(request)  # batched with the others of this moment
        streams.flush_sends()
        await _turns()
        calls = sorted([r.request_id for r in requests] for _, requests in runtime.calls)
        assert calls == [["e0"], ["t0", "t1"]]
        assert {r.purpose for _, requests in runtime.calls for r in requests
                if r.request_id == "e0"} == {"eval"}
        for call, (_, requests) in enumerate(runtime.calls):
            runtime.emit(call, None)
        await _turns()

    asyncio.run(scenario())

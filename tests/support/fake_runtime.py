"""The one in-process runtime the core tests drive the real controller and rollout with:
engines in this process (`hf` or scripted), a trainer that only records the batches it is
given, weight syncs that republish the first engine's own weights under the new version (the
trainer changes nothing), and workers a test can kill: a killed worker's streams end with
`WorkerLost` at their next result, as a dead Ray actor's do, and `replace_worker` builds a
fresh engine (`replacement`) on the published version once the test lets it.

Test doubles with another job stay next to their tests: a runtime whose results the test emits
by hand (test_rollout_interleavings.py), one on a random schedule (random_schedules.py), the
elastic pool's calls (test_elastic_driver.py) and a clock for trace spans
(test_tracing_runtime.py)."""

from __future__ import annotations

import asyncio
from typing import Callable

from eddyrl.errors import WorkerLost
from eddyrl.runtime.inprocess import InProcessRuntime


class RecordingRuntime(InProcessRuntime):
    def __init__(self, engines, *, replacement: Callable[[], object] | None = None) -> None:
        super().__init__(engines)
        self.batches: list = []
        self.synced: list[int] = []
        self.dead: set[int] = set()
        self.published = 0
        self.replacements = asyncio.Event()  # set by a test: replacements may start
        self.replaced: list[int] = []
        self._replacement = replacement

    # -- training: recorded, nothing learnt ---------------------------------------------------
    async def train(self, batch, replicas=()):
        self.batches.append(batch)
        return {"loss": 0.0, "mismatch_abs_sum": 0.0, "mismatch_tokens": float(batch.num_tokens())}

    def weights(self, version):
        return {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}

    async def sync_weights(self, version, hold=()):
        self.synced.append(version)
        weights = self.weights(version)
        for index, engine in enumerate(self.workers):
            await engine.load_weights(version, [weights], hold=index in hold)
        return [engine.version for engine in self.workers]

    # -- lost workers ---------------------------------------------------------------------------
    def kill(self, worker):
        self.dead.add(worker)

    async def generate(self, worker, requests):
        if worker in self.dead:
            raise WorkerLost(worker, "generate", "actor died")
        async for result in self.workers[worker].generate(requests):
            if worker in self.dead:
                raise WorkerLost(worker, "generate", "actor died")
            yield result

    async def replace_worker(self, worker):
        if self._replacement is None:
            raise RuntimeError("this RecordingRuntime was made without a `replacement` engine")
        await self.replacements.wait()
        engine = self._replacement()
        await engine.load_weights(self.published)
        self.workers[worker] = engine
        self.dead.discard(worker)
        self.replaced.append(worker)
        return self.published

"""Randomized schedules against the real controller and streaming rollout (issue 18's proof,
written against today's rollout before its redesign).

Each seed picks the settings (K 0-3, partial rollout, DORA's migration and legacy fill,
streaming refill, a lost worker, an elastic lend and take-back) and drives the real loop
(`eddyrl.build.build_controller`) on scripted engines whose requests finish after a seeded
number of tokens, each token followed by a seeded number of event-loop turns: the interleaving
of finishes, aborts, refusals, weight publishes and moves differs from seed to seed. After the
run: C1 (one version per trajectory, unless partial rollout), C2 (trained groups whole), C3
(lag <= K) and the ledger's exactly-once, with the run's own errors (e.g. the version
assignment's count checks) surfacing as failures.

The sweep is opt-in while the rollout still keeps a request's place in several records (some
schedules that lose a worker while another is lent still fail, see the issue's notes):
`EDDY_SCHEDULES=200 python -m pytest tests/core/test_random_schedules.py` runs 200 seeds
(`EDDY_SCHEDULE_SEED` the first one); a failure names its seed and settings.
"""

from __future__ import annotations

import asyncio
import os
import random
import zlib

import pytest

from eddyrl.build import build_controller
from eddyrl.core.config import AlgorithmConfig, LoopConfig, WindowConfig
from eddyrl.core.controller import LoopSettings
from eddyrl.core.rewarding import SafeReward
from eddyrl.errors import WorkerLost
from eddyrl.protocol import SamplingParams
from eddyrl.scheduler.elastic import ElasticConfig
from eddyrl.tasks.prompts import Prompt, PromptSet

from scripted_engine import ScriptedEngine

SCHEDULES = int(os.environ.get("EDDY_SCHEDULES", "0"))
FIRST_SEED = int(os.environ.get("EDDY_SCHEDULE_SEED", "0"))


class Lengths:
    """A request's turn length from its id and the seed (the same on any worker)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, request_id: str) -> int:
        return 1 + zlib.crc32(f"{self.seed}:{request_id}".encode()) % 6


class JitteryEngine(ScriptedEngine):
    """ScriptedEngine whose turns take a seeded number of tokens (`lengths` of the call's first
    request: the scripted engine has one turn length) and whose tokens take a seeded number of
    event-loop turns: the schedule's randomness."""

    def __init__(self, seed: int, lengths: Lengths, **kwargs):
        super().__init__(token=5, **kwargs)
        self.rng = random.Random(seed)
        self.lengths = lengths

    async def generate(self, requests):
        self.turn_tokens = self.lengths(requests[0].request_id)
        async for result in super().generate(requests):
            for _ in range(self.rng.randrange(4)):
                await asyncio.sleep(0)
            yield result


class ScheduleRuntime:
    """Engines in this process, a trainer that records batches, weight publishes that stage on
    busy engines; optionally a worker lost once (and replaced) and lending to training."""

    def __init__(self, engines, rng: random.Random, lose_at: int | None) -> None:
        self.workers = engines
        self.rng = rng
        self.batches: list[list] = []
        self.published = 0
        self.results = 0
        self.lose_at = lose_at  # the result count at which worker 0 is lost, once
        self.dead: set[int] = set()
        self.replacements = 0

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def generate(self, worker, requests):
        if worker in self.dead:
            raise WorkerLost(worker, "generate", "killed by the schedule")
        async for result in self.workers[worker].generate(requests):
            self.results += 1
            if self.lose_at is not None and self.results >= self.lose_at and worker == 0:
                self.lose_at = None
                self.dead.add(0)
            if worker in self.dead:
                raise WorkerLost(worker, "generate", "killed by the schedule")
            yield result

    async def abort(self, worker, request_ids):
        await self.workers[worker].abort(request_ids)

    async def worker_stats(self):
        return [engine.stats() for engine in self.workers]

    async def train(self, batch, replicas=()):
        self.batches.append(batch)
        for _ in range(self.rng.randrange(3)):
            await asyncio.sleep(0)
        return {}

    async def sync_weights(self, version, hold=()):
        self.published = version
        for index, engine in enumerate(self.workers):
            await engine.load_weights(version, hold=index in hold)
        return [engine.version for engine in self.workers]

    async def replace_worker(self, worker):
        old = self.workers[worker]
        engine = JitteryEngine(self.rng.randrange(1 << 30), old.lengths,
                               partial_rollout=old.partial_rollout)
        await engine.load_weights(self.published)
        self.workers[worker] = engine
        self.dead.discard(worker)
        self.replacements += 1
        return self.published

    # -- elastic: a lent worker generates nothing; its replica holds the published weights --
    async def join_training(self, worker):
        await asyncio.sleep(0)

    async def replica_version(self, worker):
        return self.published

    async def leave_training(self, worker):
        await self.workers[worker].load_weights(self.published)
        return self.workers[worker].version


def _prompts(count: int) -> PromptSet:
    return PromptSet([Prompt(i, f"p{i}", "1", (1, 3 + i % 5)) for i in range(count)], 0)


def _settings(rng: random.Random) -> tuple[dict, LoopSettings, int]:
    k = rng.randrange(4)
    partial = k > 0 and rng.random() < 0.3
    workers = rng.choice([1, 2, 3])
    choice = {"K": k, "partial": partial, "workers": workers,
              "migrate": rng.random() < 0.7, "fill_legacy": not partial and rng.random() < 0.4,
              "refill": rng.choice(["batch", "stream"]),
              "lose": workers > 1 and rng.random() < 0.3,
              "elastic": workers > 1 and rng.random() < 0.3}
    schedule = [f"1 join {workers - 1}", f"3 leave {workers - 1}"] if choice["elastic"] else []
    settings = LoopSettings(
        loop=LoopConfig(steps=5, batch_prompts=2, eval_every=0),
        algorithm=AlgorithmConfig(dynamic_sampling=False),
        window=WindowConfig(max_staleness=k, partial_rollout=partial,
                            migrate=choice["migrate"], fill_legacy=choice["fill_legacy"],
                            refill=choice["refill"]),
        sampling=SamplingParams(max_new_tokens=8), n_samples=2, seed=0, pad_id=0,
        max_batch_size=4,
        elastic=ElasticConfig(enabled=choice["elastic"], schedule=schedule,
                              min_rollout_workers=1))
    return choice, settings, workers


def run_schedule(seed: int) -> dict:
    """One seeded schedule; returns its settings; raises on any broken promise."""
    rng = random.Random(seed)
    choice, settings, workers = _settings(rng)
    lengths = Lengths(seed)
    engines = [JitteryEngine(rng.randrange(1 << 30), lengths, partial_rollout=choice["partial"])
               for _ in range(workers)]
    runtime = ScheduleRuntime(engines, rng, lose_at=rng.randrange(1, 20) if choice["lose"]
                              else None)
    prompts = _prompts(40)
    controller = build_controller(settings, runtime, prompts, _prompts(2),
                                  decode=lambda ids: "x" * len(ids),
                                  reward=SafeReward(lambda text, answer: float(len(text) % 2)),
                                  build_batch=lambda groups, pad, **_: list(groups))

    async def go():
        return await asyncio.wait_for(controller.run(), timeout=60)

    asyncio.run(go())
    k = choice["K"]
    for step, groups in enumerate(runtime.batches):  # the trainer was at version `step`
        for group in groups:
            assert len(group.trajectories) == settings.n_samples, ("C2", group.group_id)
            for trajectory in group.trajectories:
                versions = set(trajectory.result.versions)
                if not choice["partial"]:
                    assert len(versions) == 1, ("C1", group.group_id, versions)
                assert step - min(versions) <= k, ("C3", group.group_id, step, versions)
    trained = [g.group_id for groups in runtime.batches for g in groups]
    assert len(trained) == len(set(trained)), "a group trained twice as fresh"
    return choice


@pytest.mark.skipif(not SCHEDULES, reason="opt-in: EDDY_SCHEDULES=N runs N seeded schedules")
def test_random_schedules_keep_c1_c2_c3_and_exactly_once():
    failures = []
    for seed in range(FIRST_SEED, FIRST_SEED + SCHEDULES):
        try:
            run_schedule(seed)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported with its seed
            rng = random.Random(seed)
            failures.append(f"seed {seed} {_settings(rng)[0]}: {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)} of {SCHEDULES} schedules failed:\n" + \
        "\n".join(failures[:20])


# Seeds that failed on the rollout before a refused result of a request being moved was
# settled on its move's target (the assignment's book had it there; the restart took it off
# the source: "worker W has 0 running requests of version V, not 1", the CI failure of
# issue 18), and before that move's abort, still waiting on the source, was known to be stale
# for the restarted request (818 and 926 lose no worker and lend none); and (297, 711, 726,
# 898) before the elastic driver asked the rollout, not only the pool, whether a worker may
# be lent: the pool does not know that the only other worker is lost and being replaced.
REGRESSIONS = (81, 93, 99, 818, 926, 297, 711, 726, 898)


@pytest.mark.parametrize("seed", REGRESSIONS)
def test_schedules_that_broke_the_books_now_keep_every_promise(seed):
    run_schedule(seed)


def test_one_schedule_runs_its_settings_through():
    """The harness itself (fast, always on): one seed's run completes with its checks."""
    choice = run_schedule(3)
    assert set(choice) >= {"K", "partial", "workers"}

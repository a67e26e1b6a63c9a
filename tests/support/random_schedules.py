"""The harness of the randomized schedules (issue 18's proof): one seeded schedule against
the real controller and streaming rollout, checked after every event and at the end.

Each seed picks the settings (K 0-4, partial rollout, DORA's migration and legacy fill,
streaming refill, Libra's router, multi-turn episodes with tools, a lost worker and its
replacement, an elastic lend and take-back, engine faults, lost trainer ranks) and drives the
real loop (`eddyrl.build.build_controller`) on scripted engines whose turns end after a seeded
number of tokens, each token followed by a seeded number of event-loop turns, and environments
that answer after a seeded number of turns: the interleaving of dispatches, token progress,
finishes, aborts, refusals, moves, weight publishes (busy, idle, held), lends, losses, turn
ends and tool returns differs from seed to seed. Engine faults (`faults`): a duplicate final
result, progress after a final, a result for a request no one sent, a lost worker's result
arriving after its replacement — each must be counted and ignored. Trainer losses
(`trainer_loss`): a trainer rank is lost during a training step or a weight publish, before
the call took effect, after, or part way (some engines already hold the new weights), sometimes
twice in one call; the fake trainer's rebuild (`recover_trainer`) goes back to what its last
call that returned left, and the controller runs the call again (core/trainer_recovery.py).

After every event the runtime sees (each result, abort, train step, weight sync, lend,
replacement): the request table's invariants (each request in one status; the counts derived
from the records equal the kept ones) and C1 on every result (one version per response,
unless partial rollout). The book may be behind an engine for a moment (a request sent for a
version its idle engine just replaced is refused and restarts): C1 is the engines' output.
After the run: C2 (trained groups whole, every sample present), C3 (lag <= K) and
exactly-once (the ledger: no prompt trained twice as fresh, no group trained twice); with
trainer losses also: each batch the controller handed the trainer is in its committed record
exactly once, and every injected loss was recovered once and is in its step's record
(`trainer_recoveries`).

A failing seed is reported (`sweep`) with its settings, the fewest steps that still fail,
the last events, and the command that reruns it alone. The sweep over thousands of seeds:
test_random_schedules.py; the seeds that once failed and the harness's own coverage:
test_random_schedule_regressions.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
import zlib

from eddyrl.build import build_controller
from eddyrl.core.config import AlgorithmConfig, LoopConfig, WindowConfig
from eddyrl.core.controller import LoopSettings
from eddyrl.core.rewarding import SafeReward
from eddyrl.envs import Environment, EpisodeLimits, Reply
from eddyrl.envs.loading import EnvironmentFactory
from eddyrl.errors import WorkerLost
from eddyrl.protocol import GenerationResult, SamplingParams
from eddyrl.runtime_protocol import ACTOR_DIED, COLLECTIVE_TIMED_OUT, TrainerRankLost
from eddyrl.scheduler.buckets import BucketSpec, RoutingConfig
from eddyrl.scheduler.elastic import ElasticConfig
from eddyrl.tasks.prompts import Prompt, PromptSet

from scripted_engine import ScriptedEngine

RERUN = ("EDDY_SCHEDULES=1 EDDY_SCHEDULE_SEED={seed} EDDY_SCHEDULE_STEPS={steps} "
         "python -m pytest -q tests/integration/core/test_random_schedules.py -k sweep")


class Lengths:
    """A request's turn length from its id and the seed (the same on any worker)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, request_id: str) -> int:
        return 1 + zlib.crc32(f"{self.seed}:{request_id}".encode()) % 6


class JitteryEngine(ScriptedEngine):
    """ScriptedEngine whose turns take a seeded number of tokens (`lengths` of the call's first
    request) and whose tokens take a seeded number of event-loop turns; with `faults`, it
    sometimes repeats a final result, reports progress after one, or reports a request no
    one sent; with `stragglers`, a quarter of its calls are the long tail: each token takes
    tens of turns, so weights are published (and superseded) while they run and requests
    queued behind them wait."""

    def __init__(self, seed: int, lengths: Lengths, faults: bool, stragglers: bool = False,
                 **kwargs):
        super().__init__(token=5, **kwargs)
        self.rng = random.Random(seed)
        # Its own stream, so that schedules without stragglers are the ones they always were.
        self.slow = random.Random(f"{seed}:slow") if stragglers else None
        self.lengths = lengths
        self.faults = faults

    async def generate(self, requests):
        self.turn_tokens = self.lengths(requests[0].request_id)
        slow = self.slow is not None and self.slow.random() < 0.25
        async for result in super().generate(requests):
            for _ in range(self.rng.randrange(4) + (self.slow.randrange(20, 60) if slow else 0)):
                await asyncio.sleep(0)
            yield result
            if self.faults and result.final and self.rng.random() < 0.1:
                kind = self.rng.randrange(3)
                if kind == 0:
                    yield result  # the same final result again
                elif kind == 1:
                    yield GenerationResult(result.request_id, result.prompt_ids,
                                           result.token_ids, result.logprobs,
                                           result.versions, "progress")  # after final
                else:
                    yield GenerationResult("nobody-0", result.prompt_ids, [5], [-1.0],
                                           [self.version], "stop")


class Chars:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class Dice(Environment):
    """A tool environment whose answers take a seeded number of event-loop turns and whose
    episode ends at a seeded turn, with a seeded reward."""

    def __init__(self, *, seed, **base):
        super().__init__(**base)
        self.rng = random.Random(f"{seed}:{self.prompt}")
        self.last = 1 + self.rng.randrange(3)

    async def respond(self, action):
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)
        if self.turns >= self.last:
            return Reply(done=True, reward=float(self.rng.random() < 0.5))
        return Reply(text="ok", tool=self.rng.choice(["calc", "search"]),
                     status=self.rng.choice(["success", "failure"]))


class TrainerLosses:
    """Where the schedule loses a trainer rank: each attempt of a trainer call is lost with
    probability `chance`, at a seeded point among its effects (0: before the first; `effects`:
    after the last), at most `MAX_PER_CALL` times in a row, so that the call completes (the
    controller gives up after three: trainer_recovery.py). Its own stream, so that the
    schedules without trainer losses are the ones they always were."""

    MAX_PER_CALL = 2

    def __init__(self, seed: int, chance: float) -> None:
        self.rng = random.Random(f"{seed}:trainer_losses")
        self.chance = chance
        self.in_call = 0  # losses of the call now running
        self.this_step = 0  # since the last weight publish returned
        self.by_step: dict[int, int] = {}  # the version each publish made -> losses in its step
        self.where: list[tuple[str, int, int]] = []  # (call, point, effects) of each loss
        self.repeated = 0  # losses of an attempt that ran again after a loss

    @property
    def injected(self) -> int:
        return len(self.where)

    def point(self, effects: int) -> int | None:
        """The point of this attempt's loss, or None: no loss."""
        if self.chance == 0.0 or self.in_call >= self.MAX_PER_CALL or \
                self.rng.random() >= self.chance:
            return None
        return self.rng.randrange(effects + 1)

    def lose(self, during: str, point: int, effects: int) -> TrainerRankLost:
        self.repeated += self.in_call > 0
        self.in_call += 1
        self.this_step += 1
        self.where.append((during, point, effects))
        return TrainerRankLost(self.rng.randrange(4), during,
                               self.rng.choice([ACTOR_DIED, COLLECTIVE_TIMED_OUT]),
                               node=f"node-{self.rng.randrange(2)}")

    def returned(self, published: int | None = None) -> None:
        """A trainer call returned; after a weight publish, its step's losses are counted."""
        self.in_call = 0
        if published is not None:
            self.by_step[published], self.this_step = self.this_step, 0


class ScheduleRuntime:
    """Engines in this process, a trainer that records batches, weight publishes that stage on
    busy engines (held where asked); optionally worker 0 lost once (and replaced: a call of
    the lost process may still deliver one late result), lending to training, and trainer
    ranks lost (`TrainerLosses`) and the trainer rebuilt. After every event: `check`."""

    def __init__(self, engines, rng: random.Random, lose_at: int | None, partial: bool,
                 trainer_losses: TrainerLosses) -> None:
        self.workers = engines
        self.rng = rng
        self.partial = partial
        # The trainer's committed state: what its last call that returned left (the batches
        # it trained, the version it published); a rebuild goes back to it.
        self.batches: list[list] = []
        self.handed: list[list] = []  # every batch `train` was called with, each attempt
        self.losses = trainer_losses
        self.committed = (0, 0)  # (len(batches), published) when the last call returned
        self.lost_in_call: list[int] = []  # per train_step loss, the calls committed before it
        self.events: list[tuple] = []
        self.published = 0
        self.results = 0
        self.lose_at = lose_at  # the result count at which worker 0 is lost, once
        self.dead: set[int] = set()
        self.replacements = 0
        self.rollout = None  # set once the controller is built

    def check(self, event: tuple) -> None:
        self.events.append(event)
        self.rollout.table.check()

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def generate(self, worker, requests):
        if worker in self.dead:
            raise WorkerLost(worker, "generate", "killed by the schedule")
        late = False
        async for result in self.workers[worker].generate(requests):
            self.results += 1
            if self.lose_at is not None and self.results >= self.lose_at and worker == 0:
                self.lose_at = None
                self.dead.add(0)
                late = True  # this call reports the loss; others of it deliver one more
            elif worker in self.dead and not late:
                late = True
                for _ in range(3):
                    await asyncio.sleep(0)  # the loss is known by now: an old incarnation's
                yield result
            if worker in self.dead:
                raise WorkerLost(worker, "generate", "killed by the schedule")
            if not self.partial:
                assert len(set(result.versions)) <= 1, ("C1", result.request_id,
                                                        result.versions)
            yield result
            self.check(("result", worker, result.request_id, result.finish_reason))

    async def abort(self, worker, request_ids):
        await self.workers[worker].abort(request_ids)
        self.check(("abort", worker, tuple(request_ids)))

    async def worker_stats(self):
        return [engine.stats() for engine in self.workers]

    def _lost(self, during: str, point: int, effects: int) -> TrainerRankLost:
        if during == "train_step":  # which call of the run lost it: its committed calls
            self.lost_in_call.append(self.committed[0])
        lost = self.losses.lose(during, point, effects)
        self.check(("trainer rank lost", during, point, effects))
        return lost

    def _returned(self, published: int | None = None) -> None:
        self.committed = (len(self.batches), self.published)
        self.losses.returned(published)

    async def train(self, batch, replicas=()):
        self.handed.append(batch)
        lose_at = self.losses.point(1)  # 0: before the batch is trained, 1: after
        if lose_at == 0:
            raise self._lost("train_step", 0, 1)
        self.batches.append(batch)
        self.check(("train", len(self.batches), tuple(replicas)))
        for _ in range(self.rng.randrange(3)):
            await asyncio.sleep(0)
        if lose_at == 1:
            raise self._lost("train_step", 1, 1)
        self._returned()
        return {}

    async def sync_weights(self, version, hold=()):
        # the loss's point: the number of engines that received the new weights before it
        lose_at = self.losses.point(len(self.workers))
        if lose_at != 0:
            self.published = version
        for index, engine in enumerate(self.workers):
            if index == lose_at:
                raise self._lost("weight export", index, len(self.workers))
            await engine.load_weights(version, hold=index in hold)
        self.check(("sync", version, tuple(hold)))
        if lose_at == len(self.workers):
            raise self._lost("weight export", lose_at, lose_at)
        self._returned(published=version)
        return [engine.version for engine in self.workers]

    async def recover_trainer(self, lost):
        """The trainer rebuilt at its last completed step: what the interrupted attempt did to
        it is gone (engines that received its weights keep them, as real ones would). The
        rebuild takes a seeded number of event-loop turns, while the rollout goes on."""
        trained, self.published = self.committed
        del self.batches[trained:]
        for _ in range(self.losses.rng.randrange(4)):
            await asyncio.sleep(0)
        self.check(("trainer rebuilt", lost.rank, trained, self.published))
        return {"trainer_world": 2.0}

    async def replace_worker(self, worker):
        old = self.workers[worker]
        engine = JitteryEngine(self.rng.randrange(1 << 30), old.lengths, old.faults,
                               old.slow is not None, partial_rollout=old.partial_rollout)
        await engine.load_weights(self.published)
        self.workers[worker] = engine
        self.dead.discard(worker)
        self.replacements += 1
        self.check(("replaced", worker))
        return self.published

    # -- elastic: a lent worker generates nothing; its replica holds the published weights --
    async def join_training(self, worker):
        await asyncio.sleep(0)
        self.check(("lent", worker))

    async def replica_version(self, worker):
        return self.published

    async def leave_training(self, worker):
        await self.workers[worker].load_weights(self.published)
        self.check(("back", worker))
        return self.workers[worker].version


def _prompts(count: int) -> PromptSet:
    return PromptSet([Prompt(i, f"p{i}", "1", (1, 3 + i % 5)) for i in range(count)], 0)


def _settings(seed: int, steps: int = 5) -> tuple[dict, LoopSettings, int, random.Random]:
    rng = random.Random(seed)
    k = rng.randrange(5)
    partial = k > 0 and rng.random() < 0.3
    workers = rng.choice([1, 2, 3])
    choice = {"K": k, "partial": partial, "workers": workers,
              "migrate": rng.random() < 0.7, "fill_legacy": not partial and rng.random() < 0.4,
              "refill": rng.choice(["batch", "stream"]),
              "lose": workers > 1 and rng.random() < 0.3,
              "elastic": workers > 1 and rng.random() < 0.3,
              "router": workers > 1 and rng.random() < 0.3,
              "episodes": rng.random() < 0.3, "faults": rng.random() < 0.3}
    schedule = [f"1 join {workers - 1}", f"3 leave {workers - 1}"] if choice["elastic"] else []
    routing = RoutingConfig(
        policy="bucket", buckets=[BucketSpec("short", 4, workers=1),
                                  BucketSpec("long", 64, workers=workers - 1)],
        milestones=[2, 4], window=20, rebuild_every=1, min_observations=1) \
        if choice["router"] else RoutingConfig()
    env = EnvironmentFactory(Dice, "Dice", dict(tokenizer=Chars(), seed=rng.randrange(1000),
                                                limits=EpisodeLimits(max_turns=4))) \
        if choice["episodes"] else None
    settings = LoopSettings(
        loop=LoopConfig(steps=steps, batch_prompts=2, eval_every=0),
        algorithm=AlgorithmConfig(dynamic_sampling=False),
        window=WindowConfig(max_staleness=k, partial_rollout=partial,
                            migrate=choice["migrate"], fill_legacy=choice["fill_legacy"],
                            refill=choice["refill"]),
        sampling=SamplingParams(max_new_tokens=24 if env else 8), n_samples=2, seed=0,
        pad_id=0, max_batch_size=4, routing=routing, env=env,
        elastic=ElasticConfig(enabled=choice["elastic"], schedule=schedule,
                              min_rollout_workers=1))
    # Drawn from their own streams, so that adding them left every older seed's schedule as
    # it was.
    choice["stragglers"] = random.Random(f"{seed}:stragglers").random() < 0.4
    choice["trainer_loss"] = random.Random(f"{seed}:trainer_loss").random() < 0.3
    # a streamed step: its two groups trained one call each, published once (the elastic
    # pool's replicas train whole steps: train.mini_batches = 1 keeps the two apart)
    choice["stream"] = not choice["elastic"] and random.Random(f"{seed}:stream").random() < 0.3
    settings.stream_chunks = 2 if choice["stream"] else 1
    return choice, settings, workers, rng


def run_schedule(seed: int, steps: int = 5) -> tuple[dict, ScheduleRuntime]:
    """One seeded schedule; returns its settings and runtime; raises on any broken promise."""
    choice, settings, workers, rng = _settings(seed, steps)  # rng: past the settings' draws
    lengths = Lengths(seed)
    engines = [JitteryEngine(rng.randrange(1 << 30), lengths, choice["faults"],
                             choice["stragglers"], partial_rollout=choice["partial"])
               for _ in range(workers)]
    runtime = ScheduleRuntime(engines, rng, rng.randrange(1, 20) if choice["lose"] else None,
                              choice["partial"],
                              TrainerLosses(seed, 0.3 if choice["trainer_loss"] else 0.0))
    controller = build_controller(settings, runtime, _prompts(40), _prompts(2),
                                  decode=lambda ids: "x" * len(ids),
                                  reward=SafeReward(lambda text, answer: float(len(text) % 2)),
                                  build_batch=lambda groups, pad, **_: list(groups))
    runtime.rollout = controller.rollout

    async def go():
        return await asyncio.wait_for(controller.run(), timeout=60)

    try:
        summary = asyncio.run(go())
        k = choice["K"]
        for call, groups in enumerate(runtime.batches):
            step = call // settings.stream_chunks  # the trainer was at version `step`
            for group in groups:
                samples = sorted(int(t.result.request_id.rsplit("-", 1)[1])
                                 for t in group.trajectories)
                assert samples == list(range(settings.n_samples)), ("C2", group.group_id)
                for trajectory in group.trajectories:
                    versions = set(trajectory.result.versions)
                    if not choice["partial"]:
                        assert len(versions) == 1, ("C1", group.group_id, versions)
                    assert step - min(versions) <= k, ("C3", group.group_id, step, versions)
        trained = [g.group_id for groups in runtime.batches for g in groups]
        assert len(trained) == len(set(trained)), "a group trained twice as fresh"
        once = controller.ledger.check_exactly_once(range(40), 0)
        assert not once.duplicated, ("exactly-once", once)
        _check_trainer_recovery(controller, runtime, summary)
    except BaseException as exc:
        exc.add_note(f"last events: {runtime.events[-8:]}")
        raise
    return choice, runtime


def _check_trainer_recovery(controller, runtime: ScheduleRuntime, summary: dict) -> None:
    """Each batch handed to the trainer is in its committed record once, in the order handed
    (a retried attempt hands the same batch object); the last publish is the last step's; each
    injected loss was recovered once, and is in its step's record and in the summary."""
    handed = list({id(batch): batch for batch in runtime.handed}.values())
    committed = [id(batch) for batch in runtime.batches]
    assert committed == [id(batch) for batch in handed], (
        "trained once", len(handed), len(committed), len(set(committed)))
    assert runtime.published == controller.version, ("published", runtime.published,
                                                     controller.version)
    losses = runtime.losses
    assert controller.trainer.recoveries == losses.injected, (
        "recoveries", controller.trainer.recoveries, losses.where)
    assert len(summary.get("trainer_recoveries", [])) == losses.injected, (
        "summary", summary.get("trainer_recoveries"), losses.where)
    per_step = {m["step"]: m.get("trainer_recoveries", 0) for m in controller.history}
    assert per_step == {step: losses.by_step.get(step, 0) for step in per_step}, (
        "step records", per_step, losses.by_step)


def _report(seed: int, steps: int, exc: BaseException) -> str:
    """The seed, its settings, the fewest steps that still fail, the error, the last events,
    and the command that reruns it."""
    fewest = next((n for n in range(1, steps) if _fails(seed, n)), steps)
    notes = "; ".join(getattr(exc, "__notes__", []))
    return (f"seed {seed} {_settings(seed)[0]} fails from {fewest} step(s): "
            f"{type(exc).__name__}: {exc} [{notes}]\n"
            f"    rerun: {RERUN.format(seed=seed, steps=fewest)}")


def _fails(seed: int, steps: int) -> bool:
    try:
        run_schedule(seed, steps)
    except BaseException:  # noqa: BLE001 - any failure counts
        return True
    return False


def sweep(first: int, count: int, steps: int) -> list[str]:
    """Run seeds first .. first + count - 1; the reports of those that fail (at most 5)."""
    logging.disable(logging.WARNING)  # the engine faults' warnings, thousands of them
    failures = []
    for seed in range(first, first + count):
        try:
            run_schedule(seed, steps)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported with its seed
            failures.append(_report(seed, steps, exc))
            if len(failures) >= 5:
                break
    return failures

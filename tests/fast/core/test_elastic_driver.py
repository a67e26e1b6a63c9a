"""The elastic pool's config-facing parts: pinned schedules and the cross-section checks."""

import asyncio

import pytest

from eddyrl.config import load_config
from eddyrl.core.adaptive_driver import AdaptiveDriver
from eddyrl.core.elastic_driver import NoElastic, build_pool, parse_schedule
from eddyrl.errors import ConfigError
from eddyrl.scheduler.elastic import ElasticConfig, State


def test_schedule_entries_parse_and_bad_ones_are_named():
    assert parse_schedule(["3 join 1", "6 leave 1", "6 join 0"], 2) == \
        {3: [("join", 1)], 6: [("leave", 1), ("join", 0)]}
    with pytest.raises(ConfigError, match="'3 joins 1'"):
        parse_schedule(["3 joins 1"], 2)
    with pytest.raises(ConfigError, match="rollout worker 4 does not exist"):
        parse_schedule(["1 join 4"], 2)


def test_pool_ids_put_trainer_ranks_after_rollout_workers_as_the_fixed_core():
    pool = build_pool(3, 2, ElasticConfig(enabled=True))
    assert pool.rollout_workers() == [0, 1, 2] and pool.core == {3, 4}
    assert pool.state(4) is State.ACTIVE


@pytest.mark.parametrize("overrides,message", [
    (["elastic.enabled=true"], "no rollout worker could ever be lent"),
    (["elastic.enabled=true", "rollout.num_workers=2", "train.mini_batches=2"],
     "train.mini_batches = 1"),
    (["elastic.enabled=true", "rollout.num_workers=2", "algorithm.kl_coef=0.1"],
     "kl_coef = 0"),
    (["elastic.enabled=true", "rollout.num_workers=2", 'elastic.schedule=["x"]'],
     "elastic.schedule entry 'x'"),
])
def test_contradictory_elastic_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


class FakeRuntime:
    """The runtime calls the driver makes, with scripted outcomes; nothing generates."""

    def __init__(self, fail_join=False):
        self.fail_join = fail_join
        self.replica = {}  # worker -> replica weight version (-1: building, no weights yet)
        self.calls = []
        self.workers = [object(), object()]

    async def join_training(self, worker):
        self.calls.append(("join", worker))
        await asyncio.sleep(0)
        if self.fail_join:
            raise RuntimeError("rollout worker 1 failed during join training: out of memory")
        self.replica[worker] = -1

    async def replica_version(self, worker):
        return self.replica.get(worker, -1)

    async def leave_training(self, worker):
        self.calls.append(("leave", worker))
        self.replica.pop(worker, None)
        return 7  # the version its woken engine now hosts

    async def worker_stats(self):
        from eddyrl.protocol import EngineStats

        return [EngineStats(0, 0, 0, 0, 0.0) for _ in self.workers]

    def sync(self, version):  # what a weight sync does to a replica
        for worker in self.replica:
            self.replica[worker] = version


def _driver(runtime, schedule):
    from eddyrl.core.elastic_driver import ElasticDriver  # noqa: F811
    from eddyrl.core.ledger import Ledger
    from eddyrl.core.version_assignment import VersionAssignment
    from eddyrl.core.rewarding import SafeReward
    from eddyrl.core.rollout import StreamingRollout
    from eddyrl.core.version_window import VersionWindow

    rollout = StreamingRollout(runtime, VersionWindow(max_staleness=1, batch_groups=1,
                                                      max_concurrent=4),
                               VersionAssignment(2, 8), Ledger(),
                               SafeReward(lambda r, a: 0.0), decode=str)
    pool = build_pool(2, 1, ElasticConfig(enabled=True))
    return ElasticDriver(runtime, rollout, pool, schedule=parse_schedule(schedule, 2))


async def _boundaries(driver, runtime, steps):
    seen = []
    for step in range(1, steps + 1):
        runtime.sync(step)
        await driver.boundary(step, step, {})
        await asyncio.sleep(0.01)  # a step: background moves run meanwhile
        seen.append((step, driver.pool.state(1).value, driver.replicas(),
                     driver.rollout.assignment.available[1]))
    return seen


def test_driver_walks_the_join_and_leave_protocol_off_the_critical_path():
    runtime = FakeRuntime()
    driver = _driver(runtime, ["1 join 1", "5 leave 1"])
    seen = asyncio.run(_boundaries(driver, runtime, 7))
    states = [state for _, state, _, _ in seen]
    # join after 1: slept and built during step 2, fetched with step 2's sync, activated at
    # that barrier; leave after 5: contributes to step 6, detaches, back for step 7
    assert states == ["requested", "activating", "active", "active", "releasing",
                      "loading_weights", "rollout"]
    # gradients count from the step after activation until the leave detaches it
    assert [replicas for _, _, replicas, _ in seen] == [[], [1], [1], [1], [1], [], []]
    assert [available for *_, available in seen] == [False] * 6 + [True]
    assert driver.rollout.assignment.hosted[1] == 7  # what the woken engine reported
    assert runtime.calls == [("join", 1), ("leave", 1)]


def test_a_failed_join_returns_the_worker_to_rollout_and_records_why():
    runtime = FakeRuntime(fail_join=True)
    driver = _driver(runtime, ["1 join 1"])
    seen = asyncio.run(_boundaries(driver, runtime, 4))
    assert [state for _, state, _, _ in seen] == ["requested", "loading_weights", "rollout",
                                                    "rollout"]
    assert seen[-1][3] is True and all(replicas == [] for _, _, replicas, _ in seen)
    failures = [e for e in driver.events if "failed" in e]
    assert failures and "out of memory" in failures[0]["error"]
    assert any("failed" in t.reason for t in driver.pool.timeline)


def test_a_scheduled_leave_during_a_join_cancels_it_and_a_late_report_is_harmless():
    runtime = FakeRuntime()
    driver = _driver(runtime, ["1 join 1", "1 leave 1"])  # changed its mind at once
    seen = asyncio.run(_boundaries(driver, runtime, 3))
    assert [state for _, state, _, _ in seen] == ["loading_weights", "rollout", "rollout"]
    assert any(e.get("cancelled_join") for e in driver.events)
    # the join task never started (the worker left REQUESTED first); had it, its report would
    # carry an old generation and be ignored
    assert all(replicas == [] for _, _, replicas, _ in seen)


class PlanRuntime(FakeRuntime):
    def __init__(self):
        super().__init__()
        self.busy = 0.0
        self.configured = []

    def now(self):
        return 0.0

    async def worker_stats(self):
        from eddyrl.protocol import EngineStats

        self.busy += 1.0  # each worker busy 1 s per step
        return [EngineStats(0, 0, 0, 0, self.busy) for _ in self.workers]

    async def configure_rollout(self, max_batch_size, partial_rollout):
        self.configured.append((max_batch_size, partial_rollout))
        return [0, 0]


def test_an_adaptive_plan_change_is_applied_to_every_worker_and_its_cost_recorded():
    from eddyrl.scheduler.adaptive import AdaptiveConfig, AdaptiveScheduler, GenerationPlan

    runtime = PlanRuntime()
    driver = _driver(runtime, [])
    current = GenerationPlan(concurrency=64, partial_rollout=False)

    def predict(plan):  # rollout-bound; partial rollout halves the rollout time
        return (0.5 if plan.partial_rollout else 1.0), 0.4

    config = AdaptiveConfig(enabled=True, window=2, cooldown_steps=3, concurrency_choices=[64],
                            reconfiguration_cost_s=0.0, switch_partial_rollout=True)
    driver.adaptive = AdaptiveDriver(runtime, driver.rollout,
                                     AdaptiveScheduler(config, current, predict),
                                     events=driver.events)
    metrics = {"train_s": 1.0, "staleness_mean": 0.0}

    async def run():
        for step in range(1, 6):
            await driver.boundary(step, step, metrics)

    asyncio.run(run())
    plans = [e["plan"] for e in driver.events if "plan" in e]
    assert plans == [{"concurrency": 64, "partial_rollout": True}]  # once: then cooldown
    assert runtime.configured == [(64, True)] and driver.rollout.partial_rollout is True
    assert driver.adaptive.scheduler.reconfiguration_cost_s == 0.0  # measured (this runtime's clock)


def test_a_plan_with_a_bucket_layout_reassigns_the_router_and_sees_per_bucket_loads():
    from eddyrl.scheduler.adaptive import AdaptiveConfig, AdaptiveScheduler, GenerationPlan
    from eddyrl.scheduler.buckets import (BucketRouter, BucketSpec, RoutingConfig,
                                          bucket_instances)

    runtime = PlanRuntime()
    runtime.workers = [object(), object(), object()]
    driver = _driver(runtime, [])
    routing = RoutingConfig(policy="bucket", buckets=[BucketSpec("short", 10, workers=2),
                                                      BucketSpec("long", 100, workers=1)])
    driver.rollout.use_router(BucketRouter(routing, bucket_instances(routing)))
    driver.rollout.take_bucket_lengths()  # start the record, as the first boundary does
    seen = []

    def predict(plan):
        seen.append(plan)
        return (0.5 if plan.layout == (1, 2) else 1.0), 0.4

    config = AdaptiveConfig(enabled=True, window=2, cooldown_steps=3, concurrency_choices=[64],
                            reconfiguration_cost_s=0.0)
    # plans need no elastic pool: the adaptive driver alone, behind the pool's null object
    adaptive = AdaptiveDriver(runtime, driver.rollout,
                              AdaptiveScheduler(config, GenerationPlan(64, False, (2, 1)), predict))
    driver.rollout._bucket_lengths = {"long": [40, 60]}  # finished there during the step
    assert adaptive._bucket_loads()[1].requests == 2 and adaptive._bucket_loads()[1].requests == 0

    async def run():
        for step in range(1, 4):
            await NoElastic(adaptive).boundary(step, step, {"train_s": 1.0,
                                                            "staleness_mean": 0.0})

    asyncio.run(run())
    assert driver.rollout.router.layout == (1, 2)
    assert [e["plan"]["layout"] for e in adaptive.events if "plan" in e] == [[1, 2]]

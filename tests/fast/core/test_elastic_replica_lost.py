"""A replica lost mid-step, the pool's and the elastic driver's side (pure logic, no Ray):
the move is forgotten whatever state it was in, nothing is asked of the dead process, and the
rollout replaces it."""

import asyncio

import pytest

from eddyrl.core.elastic_driver import build_pool
from eddyrl.errors import WorkerLost
from eddyrl.scheduler.elastic import Do, ElasticConfig, PoolError, State
from tests.fast.core.test_elastic_driver import FakeRuntime, _boundaries, _driver

ROUTES = {  # how to bring rollout worker 1 into each state before it is lost
    State.REQUESTED: ["request_join"],
    State.FETCHING_STATE: ["request_join", "engine_slept"],
    State.ZERO_SYNC: ["request_join", "engine_slept", "state_fetched"],
    State.ACTIVATING: ["request_join", "engine_slept", "state_fetched", "boundary"],
    State.ACTIVE: ["request_join", "engine_slept", "state_fetched", "boundary", "boundary"],
    State.RELEASING: ["request_join", "engine_slept", "state_fetched", "boundary", "boundary",
                      "request_leave"],
    State.LOADING_WEIGHTS: ["request_join", "cancel"],
}


def _pool_in(state):
    pool = build_pool(3, 1, ElasticConfig(enabled=True))
    step = 0
    for event in ROUTES[state]:
        if event == "boundary":
            step += 1
            pool.step_boundary(step)
        elif event in ("request_join", "request_leave", "cancel"):
            getattr(pool, event)(1)
        else:
            getattr(pool, event)(1, pool.generation(1))
    assert pool.state(1) is state
    return pool


@pytest.mark.parametrize("state", list(ROUTES))
def test_a_lost_worker_is_forgotten_from_any_move_and_late_reports_are_stale(state):
    pool = _pool_in(state)
    before = pool.generation(1)
    action = pool.lost(1, "the actor is dead")
    assert action.kind is Do.REPLACE_WORKER and pool.state(1) is State.ROLLOUT
    assert 1 not in pool.contributors() and 1 not in pool.pairing()
    assert pool.generation(1) == before + 1
    assert pool.weights_loaded(1, before) is None  # a move's task ending late changes nothing
    assert pool.state(1) is State.ROLLOUT
    assert pool.timeline[-1].reason.startswith("ignored stale")


def test_lost_in_rollout_is_the_rollouts_business_and_a_core_replica_never_moves():
    pool = build_pool(3, 1, ElasticConfig(enabled=True))
    with pytest.raises(PoolError, match="illegal event 'lost' in state rollout"):
        pool.lost(1, "dead")
    with pytest.raises(PoolError, match="core training replica"):
        pool.lost(3, "dead")


class ReplacingRuntime(FakeRuntime):
    """Recoverable: a lost worker gets a new process at once."""

    replacements = 0

    async def replace_worker(self, worker):
        self.calls.append(("replace", worker))
        return 0


def test_a_replica_lost_mid_step_is_replaced_by_the_rollout_and_never_asked_to_leave():
    runtime = ReplacingRuntime()
    driver = _driver(runtime, ["1 join 1", "5 leave 1"])
    driver.rollout.recovery = runtime
    driver.rollout.moves.recovery = runtime

    async def run():
        seen = await _boundaries(driver, runtime, 2)  # active from step 3 on
        assert seen[-1][2] == [1]
        runtime.sync(3)
        await driver.boundary(3, 3, {"replicas_lost": {"1": "The actor is dead"}})
        await asyncio.sleep(0.01)  # the replacement, in the background
        return seen + await _boundaries_from(driver, runtime, 4, 6)

    seen = asyncio.run(run())
    assert driver.pool.state(1) is State.ROLLOUT and driver.replicas() == []
    assert runtime.calls == [("join", 1), ("replace", 1)]  # no leave of the dead process
    assert driver.rollout.workers_lost == 1
    assert driver.rollout.assignment.available[1] is True  # serving again once replaced
    assert any(e.get("lost") == "The actor is dead" for e in driver.events)
    # the scheduled leave after 5 finds nothing to leave: refused and recorded, the run goes on
    assert any(e.get("request") == "leave" and "refused" in e for e in driver.events)
    assert all(replicas == [] for _, _, replicas, _ in seen[2:])


async def _boundaries_from(driver, runtime, first, last):
    seen = []
    for step in range(first, last + 1):
        runtime.sync(step)
        await driver.boundary(step, step, {})
        await asyncio.sleep(0.01)
        seen.append((step, driver.pool.state(1).value, driver.replicas(),
                     driver.rollout.assignment.available[1]))
    return seen


class DyingRuntime(ReplacingRuntime):
    """The lent worker's process dies in its move: in the join (engine sleep, replica
    build), or when asked which weights its replica fetched."""

    def __init__(self, dies_in):
        super().__init__()
        self.dies_in = dies_in

    async def join_training(self, worker):
        await super().join_training(worker)
        if self.dies_in == "join":
            raise WorkerLost(worker, "join training", "The actor is dead")

    async def replica_version(self, worker):
        if self.dies_in == "fetch":
            raise WorkerLost(worker, "replica version", "The actor is dead")
        return await super().replica_version(worker)


@pytest.mark.parametrize("dies_in", ["join", "fetch"])
def test_a_worker_lost_while_joining_is_replaced_and_the_run_goes_on(dies_in):
    """Not a failed move (which would ask the dead process to leave): a lost worker, whose
    move is forgotten and whom the rollout replaces."""
    runtime = DyingRuntime(dies_in)
    driver = _driver(runtime, ["1 join 1"])
    driver.rollout.recovery = runtime
    driver.rollout.moves.recovery = runtime

    async def run():
        seen = await _boundaries(driver, runtime, 3)
        await asyncio.sleep(0.01)  # the replacement, in the background
        return seen

    seen = asyncio.run(run())
    assert driver.pool.state(1) is State.ROLLOUT and driver.replicas() == []
    assert runtime.calls == [("join", 1), ("replace", 1)]  # never asked to leave
    assert driver.rollout.workers_lost == 1
    assert any("The actor is dead" in e.get("lost", "") for e in driver.events)
    assert not any("failed" in e for e in driver.events)
    assert all(replicas == [] for _, _, replicas, _ in seen)


def test_a_join_of_a_worker_being_replaced_is_refused():
    runtime = FakeRuntime()
    driver = _driver(runtime, [])
    driver.rollout.assignment.set_available(1, False, lost=True)  # lost, not back yet

    async def run():
        await driver._request("join", 1, "schedule")

    asyncio.run(run())
    assert driver.events[-1]["refused"] == "rollout worker 1 was lost and is being replaced"
    assert driver.pool.state(1) is State.ROLLOUT and runtime.calls == []


def test_the_ranks_failing_on_a_dead_replicas_gradients_is_no_lost_trainer_rank():
    """Every rank's fetch of the replica's gradients raises the replica's death inside the
    rank; Ray returns it as its task error made an instance of the cause (a class named
    `RayTaskError(ActorDiedError)`, both at once): the ranks' own processes live, so the call
    fails as it was (the runtime then finds the dead replica: `dead_replicas`), no rank is
    reported lost and no trainer rebuilt."""
    from eddyrl.errors import WorkerCallError
    from eddyrl.runtime_protocol import TrainerRankLost
    from tests.fast.faults.test_trainer_rank_lost import ActorDiedError, RayTaskError, _ranks, _run

    as_cause = type("RayTaskError(ActorDiedError)", (RayTaskError, ActorDiedError), {})

    async def fetch_fails():
        raise as_cause(ActorDiedError())

    with pytest.raises(WorkerCallError) as raised:
        _run(_ranks(grace_s=0.01), fetch_fails(), fetch_fails())
    assert not isinstance(raised.value, TrainerRankLost)
    assert "trainer rank 0 failed during train_step" in str(raised.value)

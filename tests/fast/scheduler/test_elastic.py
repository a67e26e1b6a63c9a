"""The elastic pool's join/leave protocol: the full paths, cancel and failure at every state,
stale generations ignored, activation only at a barrier, pairing, limits and illegal moves."""

import random

import pytest

from eddyrl.errors import ConfigError
from eddyrl.scheduler.elastic import (Do, ElasticConfig, ElasticPool, PoolError, Role, State,
                                      Transition)

CORE = [0, 1]


def _pool(max_borrowed=3, **limits):
    workers = {0: "train", 1: "train", 2: "rollout", 3: "rollout", 4: "rollout", 5: "rollout"}
    return ElasticPool(workers, CORE, ElasticConfig(enabled=True, max_borrowed=max_borrowed,
                                                    **limits))


def _to(pool, worker, state):
    """Drive `worker` from rollout along the join (then leave) path until it is in `state`."""
    path = [(State.REQUESTED, lambda: pool.request_join(worker)),
            (State.FETCHING_STATE, lambda: pool.engine_slept(worker, pool.generation(worker))),
            (State.ZERO_SYNC, lambda: pool.state_fetched(worker, pool.generation(worker))),
            (State.ACTIVATING, lambda: pool.step_boundary(pool.step + 1)),
            (State.ACTIVE, lambda: pool.step_boundary(pool.step + 1)),
            (State.RELEASING, lambda: pool.request_leave(worker)),
            (State.LOADING_WEIGHTS, lambda: pool.step_boundary(pool.step + 1))]
    for reached, event in path:
        if pool.state(worker) is state:
            return
        event()
        assert pool.state(worker) is reached
    assert pool.state(worker) is state


def test_full_join_path_activates_at_the_barrier_paired_with_a_core_replica():
    pool = _pool()
    action = pool.request_join(2)
    assert (action.kind, action.generation, action.peer) == (Do.SLEEP_ENGINE, 1, 0)
    assert pool.role(2) is Role.TRAIN and 2 not in pool.rollout_workers()
    assert pool.engine_slept(2, 1).kind is Do.FETCH_STATE
    assert pool.state_fetched(2, 1).kind is Do.START_ZERO_GRADS
    assert pool.state(2) is State.ZERO_SYNC and pool.contributors() == CORE
    [activate] = pool.step_boundary(1)
    assert (activate.kind, activate.worker, activate.peer) == (Do.ACTIVATE, 2, 0)
    assert pool.state(2) is State.ACTIVATING and pool.contributors() == [0, 1, 2]
    [done] = pool.step_boundary(2)
    assert done.kind is Do.NONE and pool.state(2) is State.ACTIVE
    assert pool.pairing() == {2: 0} and pool.borrowed() == [2]
    assert [(t.step, t.from_state, t.to_state, t.reason) for t in pool.timeline] == [
        (0, State.ROLLOUT, State.REQUESTED, "request_join"),
        (0, State.REQUESTED, State.FETCHING_STATE, "engine_slept"),
        (0, State.FETCHING_STATE, State.ZERO_SYNC, "state_fetched"),
        (1, State.ZERO_SYNC, State.ACTIVATING, "step_boundary"),
        (2, State.ACTIVATING, State.ACTIVE, "step_boundary")]


def test_activation_happens_only_at_a_step_boundary():
    pool = _pool()
    _to(pool, 2, State.ZERO_SYNC)
    _to(pool, 3, State.FETCHING_STATE)
    pool.request_join(4)
    pool.state_fetched(3, pool.generation(3))  # other workers' events activate nothing
    assert pool.state(2) is State.ZERO_SYNC and pool.state(3) is State.ZERO_SYNC
    assert pool.contributors() == CORE, "a ZERO_SYNC worker's gradients do not count"
    actions = pool.step_boundary(1)
    assert [(a.worker, a.kind) for a in actions] == [(2, Do.ACTIVATE), (3, Do.ACTIVATE)]
    assert pool.state(4) is State.REQUESTED, "a worker still joining is not activated"
    assert pool.contributors() == [0, 1, 2, 3]


def test_leave_path_stops_contributing_at_the_boundary_then_returns_to_rollout():
    pool = _pool()
    _to(pool, 2, State.ACTIVE)
    action = pool.request_leave(2)
    assert action.kind is Do.RELEASE_AT_BOUNDARY and action.generation == 2
    assert pool.contributors() == [0, 1, 2], "it still contributes to the step in flight"
    [detach] = pool.step_boundary(pool.step + 1)
    assert (detach.kind, detach.peer, detach.generation) == (Do.DETACH_AND_WAKE, 0, 2)
    assert pool.state(2) is State.LOADING_WEIGHTS and pool.role(2) is Role.ROLLOUT
    assert pool.contributors() == CORE and pool.pairing() == {} and 2 not in pool.rollout_workers()
    assert pool.weights_loaded(2, 2).kind is Do.RETURN_TO_ROLLOUT
    assert pool.state(2) is State.ROLLOUT and 2 in pool.rollout_workers()


@pytest.mark.parametrize("state,after,cleanup", [
    (State.REQUESTED, State.LOADING_WEIGHTS, Do.WAKE_ENGINE_AND_LOAD),
    (State.FETCHING_STATE, State.LOADING_WEIGHTS, Do.ABORT_FETCH_AND_WAKE),
    (State.ZERO_SYNC, State.LOADING_WEIGHTS, Do.DETACH_AND_WAKE),
    (State.ACTIVATING, State.RELEASING, Do.RELEASE_AT_BOUNDARY),  # leaves at the next barrier
])
def test_cancel_of_a_join_at_every_state_returns_to_rollout(state, after, cleanup):
    pool = _pool()
    _to(pool, 2, state)
    generation = pool.generation(2)
    action = pool.cancel(2)
    assert (action.kind, action.generation) == (cleanup, generation + 1)
    assert pool.state(2) is after
    if after is State.RELEASING:
        assert pool.step_boundary(pool.step + 1)[0].kind is Do.DETACH_AND_WAKE
    assert pool.pairing() == {} and pool.contributors() == CORE
    assert pool.weights_loaded(2, pool.generation(2)).kind is Do.RETURN_TO_ROLLOUT
    assert pool.state(2) is State.ROLLOUT and pool.role(2) is Role.ROLLOUT


def test_cancel_of_a_leave_keeps_training_and_nothing_else_is_cancellable():
    pool = _pool()
    _to(pool, 2, State.RELEASING)
    action = pool.cancel(2)
    assert action.kind is Do.NONE and pool.state(2) is State.ACTIVE
    assert pool.step_boundary(pool.step + 1) == [] and pool.contributors() == [0, 1, 2]
    _to(pool, 3, State.LOADING_WEIGHTS)
    for worker, state in ((2, "active"), (3, "loading_weights"), (4, "rollout")):
        with pytest.raises(PoolError, match=f"worker {worker}: illegal event 'cancel' in state "
                                            f"{state}"):
            pool.cancel(worker)


@pytest.mark.parametrize("state,cleanup", [
    (State.REQUESTED, Do.WAKE_ENGINE_AND_LOAD),
    (State.FETCHING_STATE, Do.ABORT_FETCH_AND_WAKE),
    (State.ZERO_SYNC, Do.DETACH_AND_WAKE),
    (State.ACTIVATING, Do.DROP_GRADIENTS_AND_WAKE),
    (State.ACTIVE, Do.DROP_GRADIENTS_AND_WAKE),
    (State.RELEASING, Do.DROP_GRADIENTS_AND_WAKE),
    (State.LOADING_WEIGHTS, Do.WAKE_ENGINE_AND_LOAD),  # retry the load
])
def test_failure_at_every_state_returns_to_rollout_with_its_cleanup(state, cleanup):
    pool = _pool()
    _to(pool, 2, state)
    action = pool.failed(2, "engine crashed")
    assert action.kind is cleanup and action.reason == "failed: engine crashed"
    assert pool.state(2) is State.LOADING_WEIGHTS
    assert pool.contributors() == CORE, "a failed worker's gradients are dropped at once"
    assert pool.pairing() == {}
    assert pool.weights_loaded(2, pool.generation(2)).kind is Do.RETURN_TO_ROLLOUT
    assert pool.state(2) is State.ROLLOUT


def test_failure_of_a_rollout_worker_or_a_core_replica_is_not_the_protocols():
    pool = _pool()
    with pytest.raises(PoolError, match="worker 3: illegal event 'failed' in state rollout"):
        pool.failed(3, "oom")
    with pytest.raises(PoolError, match="worker 0: illegal event 'failed': it is a core"):
        pool.failed(0, "oom")


def test_a_late_state_fetched_from_a_cancelled_join_activates_nothing():
    pool = _pool()
    _to(pool, 2, State.FETCHING_STATE)
    stale = pool.generation(2)
    pool.cancel(2)
    assert pool.state_fetched(2, stale) is None
    assert pool.state(2) is State.LOADING_WEIGHTS
    assert pool.step_boundary(1) == [] and pool.contributors() == CORE
    assert pool.timeline[-1] == Transition(0, 2, State.LOADING_WEIGHTS, State.LOADING_WEIGHTS,
                                           "ignored stale state_fetched (generation 1, "
                                           "current 2)")
    # Even once the worker joins again, the old report does not skip the new join's fetch.
    pool.weights_loaded(2, pool.generation(2))
    _to(pool, 2, State.FETCHING_STATE)
    assert pool.state_fetched(2, stale) is None and pool.state(2) is State.FETCHING_STATE
    assert pool.failed(2, "old fetch timed out", generation=stale) is None
    assert pool.state(2) is State.FETCHING_STATE
    assert pool.state_fetched(2, pool.generation(2)).kind is Do.START_ZERO_GRADS


def test_a_future_generation_is_a_bug():
    pool = _pool()
    pool.request_join(2)
    with pytest.raises(PoolError, match="worker 2: engine_slept for generation 5, but the pool "
                                        "is only at generation 1"):
        pool.engine_slept(2, 5)


def test_pairing_spreads_joined_replicas_over_core_replicas_fewest_first():
    pool = _pool(max_borrowed=4)
    for worker in (2, 3, 4):
        pool.request_join(worker)
    assert pool.pairing() == {2: 0, 3: 1, 4: 0}
    pool.cancel(2)
    pool.weights_loaded(2, pool.generation(2))
    assert pool.request_join(5).peer == 0  # 0 and 1 now hold one each: the lower id wins
    assert pool.pairing() == {3: 1, 4: 0, 5: 0}


def test_a_non_core_train_worker_starts_active_and_paired():
    pool = ElasticPool({0: Role.TRAIN, 1: "train", 2: "rollout"}, [0])
    assert pool.state(1) is State.ACTIVE and pool.pairing() == {1: 0}
    assert pool.contributors() == [0, 1] and pool.leavable() == [1]


@pytest.mark.parametrize("state,event,call", [
    (State.REQUESTED, "state_fetched", lambda p: p.state_fetched(2, p.generation(2))),
    (State.ZERO_SYNC, "request_leave", lambda p: p.request_leave(2)),
    (State.ACTIVE, "request_join", lambda p: p.request_join(2)),
    (State.ROLLOUT, "weights_loaded", lambda p: p.weights_loaded(2, 0)),
    (State.FETCHING_STATE, "engine_slept", lambda p: p.engine_slept(2, p.generation(2))),
])
def test_illegal_transitions_name_worker_state_and_event(state, event, call):
    pool = _pool()
    _to(pool, 2, state)
    before = list(pool.timeline)
    with pytest.raises(PoolError, match=f"worker 2: illegal event '{event}' in state "
                                        f"{state.value}"):
        call(pool)
    assert pool.state(2) is state and pool.timeline == before, "a refusal changes nothing"


def test_core_replicas_unknown_workers_and_steps_backwards_are_refused():
    pool = _pool()
    with pytest.raises(PoolError, match="worker 1: illegal event 'request_leave': it is a core"):
        pool.request_leave(1)
    with pytest.raises(PoolError, match="worker 9 is not in the pool"):
        pool.request_join(9)
    pool.step_boundary(3)
    with pytest.raises(PoolError, match=r"step_boundary\(3\) after step 3"):
        pool.step_boundary(3)
    with pytest.raises(PoolError, match="core replica 2 must be a worker with role 'train'"):
        ElasticPool({0: "train", 2: "rollout"}, [0, 2])


def test_limits_max_borrowed_min_rollout_and_min_train():
    pool = _pool(max_borrowed=1)
    pool.request_join(2)
    assert pool.joinable() == []
    with pytest.raises(PoolError, match="worker 3: request_join refused: 1 worker.* max_borrowed"):
        pool.request_join(3)
    pool = _pool(max_borrowed=4, min_rollout_workers=2)
    pool.request_join(2)
    pool.request_join(3)
    with pytest.raises(PoolError, match="min_rollout_workers = 2"):
        pool.request_join(4)
    pool = _pool(min_train_workers=3)
    _to(pool, 2, State.ACTIVE)
    with pytest.raises(PoolError, match="worker 2: request_leave refused.*min_train_workers = 3"):
        pool.request_leave(2)


def test_random_drives_keep_the_invariants():
    """Random legal and stale events: contributors change only at boundaries or on failure,
    only training-side workers are paired, and borrowing stays within its limit."""
    rng = random.Random(0)
    pool = _pool(max_borrowed=2)
    for _ in range(3000):
        worker = rng.choice([2, 3, 4, 5])
        stale = max(0, pool.generation(worker) - rng.choice([0, 0, 1]))
        event = rng.choice(["join", "slept", "fetched", "loaded", "leave", "cancel", "failed",
                            "boundary"])
        before = pool.contributors()
        calls = {"join": lambda: pool.request_join(worker),
                 "slept": lambda: pool.engine_slept(worker, stale),
                 "fetched": lambda: pool.state_fetched(worker, stale),
                 "loaded": lambda: pool.weights_loaded(worker, stale),
                 "leave": lambda: pool.request_leave(worker),
                 "cancel": lambda: pool.cancel(worker),
                 "failed": lambda: pool.failed(worker, "chaos"),
                 "boundary": lambda: pool.step_boundary(pool.step + 1)}
        try:
            calls[event]()
        except PoolError:
            continue
        if event not in ("boundary", "failed"):
            assert pool.contributors() == before, event
        assert set(pool.pairing()) == set(pool.borrowed())
        assert len(pool.borrowed()) <= 2
    assert {t.to_state for t in pool.timeline} == set(State)


def test_config_validation_names_the_key():
    ElasticConfig().validate("elastic")
    with pytest.raises(ConfigError, match="'elastic.min_rollout_workers' = 0"):
        ElasticConfig(min_rollout_workers=0).validate("elastic")
    with pytest.raises(ConfigError, match="elastic.enabled = True with elastic.max_borrowed = 0"):
        ElasticConfig(enabled=True, max_borrowed=0).validate("elastic")

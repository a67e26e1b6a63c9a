"""The controller's state in a run checkpoint (`core/run_state.py` and the `state`/`restore`
of the objects it covers): replay groups round-trip exactly through safetensors + JSON, the
prompt queue goes on where it stopped, the window and replay buffer come back, the ledger
requeues untrained groups only on a resume, and other data or another seed is refused."""

import pytest

from eddyrl.core import run_state
from eddyrl.core.ledger import Ledger, LedgerError, State
from eddyrl.core.replay import ReplayBuffer, ReplayConfig
from eddyrl.protocol import GenerationResult, Group, Trajectory
from eddyrl.core.version_window import VersionWindow, VersionWindowError
from eddyrl.errors import ConfigError
from eddyrl.tasks.prompts import Prompt, PromptQueue, PromptSet


def _prompts(count=10):
    return PromptSet([Prompt(i, f"p{i}", str(i), (1, 2, i)) for i in range(count)], 0)


def _group(name, with_mask):
    results = [GenerationResult(f"{name}-{s}", [1, 2, 3], [5 + s, 6, 7][:2 + s],
                                [-0.1234567890123, -1e-30, -7.5][:2 + s], [3] * (2 + s),
                                "stop" if s else "length",
                                loss_mask=[1, 0, 1][:2 + s] if with_mask else None)
               for s in range(2)]
    return Group(name, "prompt text", "42", [1, 2, 3], dispatch_version=3,
                 trajectories=[Trajectory(results[0], 1.0),
                               Trajectory(results[1], 0.1 + 0.2, reward_error="boom")])


def test_replay_groups_round_trip_exactly_without_pickle(tmp_path):
    groups = [_group("g1", with_mask=False), _group("g2", with_mask=True), Group("g3", "", "",
                                                                                 [], 0)]
    metas, tensors = run_state._pack_groups(groups)
    meta = {"format": 1, "step": 4, "seed": 0, "data": {}, "window": {}, "replay": {},
            "next_group_id": 0, "reward_errors": 0, "history": [], "rng": {}, "groups": metas}
    state = run_state.RunState(meta, {"step": 4, "groups": {}}, tensors)
    run_state.write(tmp_path, state)
    back = run_state.read(tmp_path)
    assert run_state._unpack_groups(back.meta["groups"], back.tensors) == groups


def test_the_prompt_queue_goes_on_where_it_stopped():
    straight = PromptQueue(_prompts(), batch_size=4, seed=7)
    resumed = PromptQueue(_prompts(), batch_size=4, seed=7)
    first = straight.take(3) + straight.take(8)  # an epoch boundary, prompts left pending
    resumed.restore(straight.state())
    assert straight.state()["pending"] and straight.state()["epoch"] == 1
    key = lambda drawn: [(epoch, prompt.index) for epoch, prompt in drawn]
    assert key(resumed.take(17)) == key(straight.take(17))
    assert sorted(p.index for e, p in first if e == 0) == list(range(10))


def test_window_and_replay_buffer_restore_their_state():
    window = VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=4)
    for g in "abcd":
        window.dispatch(g)
    window.collect("a"), window.collect("b"), window.collect("c")
    assert window.take_batch() == ["a", "b"]
    window.advance()  # "c" collected and "d" running: a resume generates both again
    fresh = VersionWindow(max_staleness=1, batch_groups=2, max_concurrent=4)
    fresh.restore(window.state())
    assert (fresh.version, fresh.accepted, fresh.running) == (1, 2, 0)
    with pytest.raises(VersionWindowError, match="cannot restore"):
        window.restore(fresh.state())

    config = ReplayConfig(max_fraction=0.5, max_lag=2, capacity=2)
    buffer = ReplayBuffer(config)
    for i, version in enumerate((0, 1, 1)):  # the third add evicts the first (capacity)
        buffer.add(_group(f"g{i}", True), version, informative=i != 1)
    buffer.select(2, trainer_version=2)
    copy = ReplayBuffer(config)
    copy.restore(buffer.state())
    assert copy.state() == buffer.state() and copy.stats() == buffer.stats()
    assert [g.group_id for g, _ in copy.select(2, 3)] == [g.group_id for g, _ in
                                                         buffer.select(2, 3)]


def test_only_a_resume_requeues_a_collected_group():
    ledger = Ledger()
    ledger.queue("g", 0, 0)
    ledger.start("g", 1, 0)
    ledger.collect("g")
    with pytest.raises(LedgerError, match="collected -> queued"):
        ledger.requeue("g", "worker died")  # a worker failure never loses collected output
    ledger.requeue_lost("g", "resumed")
    ledger.start("g", 0, 1)
    ledger.collect("g")
    ledger.train_fresh("g", 2)
    assert [e.state for e in ledger.history("g")].count(State.TRAINED_FRESH) == 1
    assert ledger.check_exactly_once([0], 0).ok


def test_a_resume_refuses_another_seed_or_other_data():
    prompts = _prompts()

    def check(seed=1, fingerprint=prompts.fingerprint, index=3):
        ledger = {"step": 0, "groups": {"g": {"prompt_index": index}}}
        state = run_state.RunState({"seed": seed, "data": {"fingerprint": fingerprint}},
                                   ledger, {})
        run_state.check_compatible(state, seed=1, fingerprint=prompts.fingerprint,
                                   prompts=len(prompts.prompts))

    check()
    with pytest.raises(ConfigError, match="config key 'seed' = 1 .* seed = 2"):
        check(seed=2)
    with pytest.raises(ConfigError, match="training prompts differ"):
        check(fingerprint=_prompts(11).fingerprint)
    # a ledger naming a prompt the data does not have: refused by name, not an IndexError
    with pytest.raises(ConfigError, match=r"group 'g' names prompt 10, but the training data "
                                          r"has 10 prompts \(0 to 9\)"):
        check(index=10)


def test_a_resume_on_another_platform_needs_the_platform_named():
    state = run_state.RunState({"platforms": {"rollout": "npu", "train": "npu"}}, {}, {})
    same = {"rollout": "npu", "train": "npu"}
    run_state.check_platforms(state, same, {"rollout": False, "train": False})
    moved = {"rollout": "npu", "train": "cpu"}
    with pytest.raises(ConfigError) as err:  # auto (or EDDY_PLATFORM) found the CPU
        run_state.check_platforms(state, moved, {"rollout": False, "train": False})
    message = str(err.value)
    assert "train role on platform 'npu'" in message and "resolved 'cpu'" in message
    assert "train.platform=cpu" in message
    run_state.check_platforms(state, moved, {"rollout": False, "train": True})  # named: moved
    # a checkpoint from before platforms were recorded carries none: nothing to compare
    run_state.check_platforms(run_state.RunState({}, {}, {}), moved, {})

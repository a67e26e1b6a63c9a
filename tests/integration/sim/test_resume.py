"""Exact resume, driven through the real controller on the simulator: a run checkpointed after
step k and resumed in a fresh controller ends exactly as the uninterrupted run (synchronous),
falls back past a corrupt newest checkpoint, and with groups in flight at the checkpoint
(asynchronous) regenerates them, losing none and training none twice as fresh."""

import json

import pytest

from eddyrl import checkpoints, resume
from eddyrl.sim.config import load_scenario as load_config
from eddyrl.core import run_state
from eddyrl.core.ledger import State
from eddyrl.sim.runtime import build
from eddyrl.sim.clock import run_virtual

# 20 prompts, 6 fresh groups a step (batch 8 less 2 replay slots): steps cross an epoch, leave
# drawn prompts pending, and the replay buffer holds groups at every checkpoint.
SCENARIO = ["sim.model=Qwen3-4B", "sim.rollout.accelerator=H100", "sim.train.accelerator=H100",
            "sim.rollout.devices=2", "sim.train.devices=2", "sim.workload.prompts=20",
            "sim.workload.eval_prompts=4", "sim.workload.max_response_tokens=4000",
            "loop.steps=6", "loop.batch_prompts=8", "loop.eval_every=2", "rollout.n_samples=4",
            "replay.max_fraction=0.25", "replay.max_lag=2"]


def _straight_run(config, run_dir, at_steps):
    """The uninterrupted run, writing run checkpoints (controller state only) after
    `at_steps`; a crash after any of them would lose what follows."""
    controller, _ = build(config)

    async def checkpoint(step):
        if step in at_steps:
            await resume.save(controller, None, run_dir, step, keep_last=5)
    controller.checkpoint = checkpoint
    run_virtual(controller.run())
    return controller


def _resumed_run(config, run_dir):
    point = resume.find("auto", run_dir)
    controller, _ = build(config)  # a new process: nothing shared with the first run
    requeued = run_state.restore(controller, point.state)
    run_virtual(controller.run())
    return controller, point, requeued


def _same(a, b):
    """Equal, except simulated durations: the resumed clock starts at 0, so a difference of
    two times rounds differently in the last bits."""
    a, b = json.loads(json.dumps(a)), json.loads(json.dumps(b))
    if isinstance(a, float):
        return b == pytest.approx(a, rel=1e-9)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_resumed_run_ends_exactly_as_the_uninterrupted_one(tmp_path):
    config = load_config(overrides=SCENARIO)
    straight = _straight_run(config, tmp_path, at_steps={3})
    resumed, point, requeued = _resumed_run(config, tmp_path)
    assert point.step == 3 and requeued == []  # synchronous: nothing in flight at a boundary
    assert resumed.ledger.to_dict() == straight.ledger.to_dict()  # the same groups, ids, steps
    assert _same(resumed.history, straight.history)
    assert resumed.replay.state()["entries"] and \
        [e["group"] for e in resumed.replay.state()["entries"]] == \
        [e["group"] for e in straight.replay.state()["entries"]]
    fresh = [(e.step, gid) for gid in straight.ledger.to_dict()["groups"]
             for e in straight.ledger.history(gid) if e.state is State.TRAINED_FRESH]
    assert len(fresh) == 6 * 6 - sum(m.get("groups_generated", 0) - m.get("groups_kept", 0)
                                     for m in straight.history)  # dynamic sampling's drops


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, caplog):
    config = load_config(overrides=SCENARIO)
    straight = _straight_run(config, tmp_path, at_steps={2, 4})
    newest = tmp_path / "checkpoints" / "step_000004"
    (newest / run_state.TENSOR_FILE).write_bytes(b"not what was written")
    resumed, point, _ = _resumed_run(config, tmp_path)
    assert point.step == 2 and point.path.name == "step_000002"
    assert len(point.skipped) == 1 and "step_000004" in point.skipped[0]
    assert "step_000004" in caplog.text and "falling back" in caplog.text
    assert resumed.ledger.to_dict() == straight.ledger.to_dict()
    assert _same(resumed.history, straight.history)


@pytest.mark.parametrize("refill", ["batch", "stream"])
def test_groups_in_flight_at_the_checkpoint_are_generated_again_exactly_once(tmp_path, refill):
    """K = 2: at the checkpoint groups are generating (and collected, not trained). They come
    back under their own ids, generated on the restored policy before any new prompt; every
    group queued is trained once as fresh or still in flight at the end, none twice."""
    config = load_config(overrides=[
        *SCENARIO, "replay.max_fraction=0", "algorithm.dynamic_sampling=false",
        "window.max_staleness=2", f"window.refill={refill}", "sim.workload.prompts=16"])
    _straight_run(config, tmp_path, at_steps={3})
    resumed, point, requeued = _resumed_run(config, tmp_path)
    before = point.state.ledger["groups"]
    in_flight = [gid for gid, r in before.items()
                 if r["history"][-1]["state"] in ("generating", "collected")]
    assert requeued and requeued == in_flight
    ledger = resumed.ledger
    for gid in requeued:
        history = ledger.history(gid)
        requeue = next(i for i, e in enumerate(history) if e.reason and "resumed" in e.reason)
        assert history[requeue].state is State.QUEUED and history[requeue].step == 3
        started = history[requeue + 1]  # generated again, on the restored policy or later
        assert started.state is State.GENERATING and started.version >= 3
    # each (epoch, prompt) trained fresh at most once; the 6 steps trained 6 batches of 8
    states = ledger.counts()
    assert states[State.QUEUED] == 0 and states[State.GENERATING] == 0
    assert states[State.DONE] == 6 * 8
    for epoch in (0, 1, 2):
        counts = ledger.fresh_train_counts_by_prompt(epoch)
        assert set(counts.values()) <= {0, 1}
    assert ledger.check_exactly_once(range(16), epoch=0).ok  # epochs 0 and 1 are complete
    assert ledger.check_exactly_once(range(16), epoch=1).ok
    assert checkpoints.verify(point.path)["step"] == 3

"""The stability governor in whole runs: a tiny `eddy train` run with K = 2 and a limit its
signal always passes lowers K, logs every decision in metrics.jsonl, finishes, and trains every
sample once; and a resumed run (on the simulator) goes on with the K the governor had reached."""

import json

import pytest

from eddyrl import resume
from eddyrl.core import run_state
from eddyrl.core.ledger import State
from eddyrl.sim.clock import run_virtual
from eddyrl.sim.config import load_scenario
from eddyrl.sim.runtime import build

RUN = ["loop.batch_prompts=4", "loop.eval_every=0", "rollout.n_samples=4",
       "rollout.max_new_tokens=16", "data.train_size=32", "data.eval_size=4",
       "cluster.threads_per_worker=1", "data.reward_fn=reward_fixtures:length_reward",
       "algorithm.dynamic_sampling=false", "cluster.runtime=local"]
# mismatch KL > 0 whenever the trainer's policy differs from the one that sampled: always on
# data a step or more old
GOVERNED = ["window.max_staleness=2", "window.governor=true",
            "window.governor_max_mismatch_kl=0", "window.governor_min_ess=null",
            "window.governor_max_masked_fraction=null"]


@pytest.mark.slow
def test_a_governed_run_lowers_k_logs_each_decision_and_trains_every_sample_once(
        tiny_model_dir, tmp_path):
    from eddyrl.config import load_config
    from eddyrl.core.ledger import Ledger
    from eddyrl.launch import train

    steps_n = 8
    config = load_config(overrides=[f"model.path={tiny_model_dir}", f"run_dir={tmp_path}",
                                    "platform=cpu", *RUN, f"loop.steps={steps_n}", *GOVERNED])
    summary = json.loads(train(config).read_text())
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()][1:]
    assert len(steps) == steps_n
    for m in steps:
        assert {"governor_k", "governor_action", "governor_reason"} <= m.keys(), m
        assert 0 <= m["governor_k"] <= 2 and m["staleness_max"] <= 2  # bounds and C3
    lowered = [m for m in steps if m["governor_action"] == "lower"]
    assert lowered and "mismatch_kl" in lowered[0]["governor_reason"]
    assert all(m["governor_action"] != "raise" for m in steps)  # never calm: the limit is 0
    assert steps[-1]["governor_k"] < 2
    # groups admitted before the first lowering (K = 2) are trained by two steps later; from
    # then on every trained sample was admitted under the lowered K (never raised here)
    later = [m for m in steps if m["step"] > lowered[0]["step"] + 2]
    assert later and max(m["staleness_max"] for m in later) <= lowered[0]["governor_k"]
    assert summary["governor"]["k"] == steps[-1]["governor_k"]
    assert summary["governor"]["lowered"] == len(lowered)
    # exactly once: every trained sample's prompt trained fresh once, none lost in flight
    assert summary["ledger"]["generating"] == 0 and summary["ledger"]["queued"] == 0
    ledger = Ledger.from_dict(json.loads((tmp_path / "checkpoint" / "ledger.json").read_text()))
    counts = ledger.fresh_train_counts_by_prompt(0)
    assert sum(counts.values()) == steps_n * 4 and set(counts.values()) <= {0, 1}
    assert ledger.check_exactly_once(range(32), epoch=0).ok  # 8 steps x 4: the whole epoch
    assert sum(m["samples_trained"] for m in steps) == steps_n * 4 * 4



@pytest.mark.slow
def test_on_policy_trouble_narrows_the_correction_bounds_the_trainer_then_applies(
        tiny_model_dir, tmp_path):
    """K = 0, a bf16 rollout against the fp32 trainer and a mismatch limit of 0: K cannot
    help, so the governor narrows icepop's bounds, and the next step's loss masks more of the
    same tokens than a run whose governor may not narrow them (same seed: step 1 and the
    batch of step 2 are the same in both runs)."""
    from eddyrl.config import load_config
    from eddyrl.launch import train

    def run(min_scale: float, name: str) -> list[dict]:
        config = load_config(overrides=[
            f"model.path={tiny_model_dir}", f"run_dir={tmp_path / name}", "platform=cpu",
            *RUN, "loop.steps=2", "rollout.dtype=bf16", "window.max_staleness=0",
            "window.governor=true", "window.governor_max_mismatch_kl=0",
            "window.governor_min_ess=null", "window.governor_max_masked_fraction=null",
            f"window.governor_min_correction_scale={min_scale}",
            "algorithm.correction=icepop", "algorithm.correction_low=0.9999",
            "algorithm.correction_high=1.0001"])
        train(config)
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()][1:]

    narrowed, fixed = run(0.25, "narrowed"), run(1.0, "fixed")
    assert [(m["governor_action"], m["governor_correction_scale"]) for m in narrowed] == \
        [("narrow", 0.5), ("narrow", 0.25)]
    assert [(m["governor_action"], m["governor_correction_scale"]) for m in fixed] == \
        [("hold", 1.0), ("hold", 1.0)]
    assert narrowed[0]["correction_masked_fraction"] == fixed[0]["correction_masked_fraction"]
    assert narrowed[1]["mismatch_kl"] == fixed[1]["mismatch_kl"]  # the same batch and weights
    # step 2 trained with [0.9999, 1.0001] ** 0.5, about [0.99995, 1.00005]: strictly more
    # tokens masked (measured: 0.970 against 0.941)
    assert narrowed[1]["correction_masked_fraction"] > fixed[1]["correction_masked_fraction"]

SCENARIO = ["sim.model=Qwen3-4B", "sim.rollout.accelerator=H100", "sim.train.accelerator=H100",
            "sim.rollout.devices=2", "sim.train.devices=2", "sim.workload.prompts=16",
            "sim.workload.eval_prompts=4", "sim.workload.max_response_tokens=4000",
            "loop.steps=8", "loop.batch_prompts=4", "loop.eval_every=0", "rollout.n_samples=4",
            "algorithm.dynamic_sampling=false", "window.max_staleness=3",
            "window.governor=true", "window.governor_calm_steps=2"]


def _governed(config):
    """The simulator's controller, its trainer reporting a mismatch that passes the limit
    (0.01) exactly when the batch held data two or more versions old: K settles between 1
    and 2, so a checkpoint falls on a K the config does not name."""
    controller, runtime = build(config)
    simulated, build_batch = runtime.train, controller.build_batch
    lag = [0]

    def batch_with_lag(groups, *args, **kwargs):
        lag[0] = max(controller.version - group.dispatch_version for group in groups)
        return build_batch(groups, *args, **kwargs)

    async def train(batch, replicas=()):
        return {**await simulated(batch, replicas), "mismatch_kl": 0.006 * lag[0]}
    controller.build_batch, runtime.train = batch_with_lag, train
    return controller


def test_a_resumed_run_goes_on_with_the_governors_k(tmp_path):
    config = load_scenario(overrides=SCENARIO)
    straight = _governed(config)

    async def checkpoint(step):
        if step == 4:
            await resume.save(straight, None, tmp_path, step, keep_last=2)
    straight.checkpoint = checkpoint
    run_virtual(straight.run())
    at_checkpoint = straight.history[4]
    point = resume.find("auto", tmp_path)
    saved = point.state.meta["governor"]
    assert saved["k"] == at_checkpoint["governor_k"] < 3, "the governor had moved K"

    resumed = _governed(config)
    run_state.restore(resumed, point.state)
    assert resumed.governor.state() == saved
    assert resumed.window.max_staleness == saved["k"]  # new admissions under the saved K
    run_virtual(resumed.run())
    after = resumed.history[5:]
    assert after and all(0 <= m["governor_k"] <= 3 for m in after)
    assert resumed.ledger.counts()[State.GENERATING] == 0
    for epoch in range(3):
        assert set(resumed.ledger.fresh_train_counts_by_prompt(epoch).values()) <= {0, 1}
    # a checkpoint whose governor entry is damaged is refused by name, not restored
    from eddyrl.checkpoints import CheckpointError

    state_file = point.path / run_state.STATE_FILE
    meta = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**meta, "governor": {"k": "two", "calm": 0}}))
    with pytest.raises(CheckpointError, match="state.json's governor: 'k' = 'two' is not an int"):
        run_state.read(point.path)

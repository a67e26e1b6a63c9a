"""A rollout worker lent to training (Libra's elastic pool), killed mid-step as a gradient
replica (issue 37), on a local Ray with two trainer ranks: the step it was in is rerun by the
core ranks alone on the same batch, the worker is replaced as any lost rollout worker, and the
run finishes.

Before, the trainer rank's fetch of the replica's gradients failed with the replica's actor
death and the run ended ("trainer rank 0 failed during train_step (with replicas [1]): ...").

The replica dies from inside (`eddyrl/fault_points.py`, `replica_step`) in its first gradient
call, whichever version its weights are then (when a join completes depends on the machine's
speed): one fault per version, only the first can fire, since the dead worker's move is
forgotten and nothing joins it again. The join is asked for after step 1 and takes a step or two
(its requests finish, its engine sleeps, the replica is built, fetches the weights, activates at
a boundary); the run's steps leave it several more.

The rerun starts from no gradients: a trainer rank whose fetch of a replica's gradients failed
(after its own backward passes, before its optimizer step) discards its own, so its rerun is the
step a fresh rank takes on the same batch, bit for bit (`test_a_failed_replica_fetch_...`).
"""

import json

import pytest
import torch

import eddy_process as run
from fsdp_helpers import make_batch
from eddyrl.config import load_config
from eddyrl.core.ledger import Ledger
from eddyrl.resolved import runtime_settings
from eddyrl.runtime import trainer_rank

STEPS = 8
PROMPTS, SAMPLES = 4, 4  # eddy_process.RUN's batch
RUN = ("cluster.runtime=ray", "rollout.num_workers=2", "train.num_workers=2",
       f"loop.steps={STEPS}", "checkpoint.every=0", "elastic.enabled=true",
       'elastic.schedule=["1 join 1"]')


@pytest.mark.slow
def test_a_replica_killed_mid_step_is_dropped_from_the_step_and_the_run_goes_on(
        tiny_model_dir, tmp_path):
    run_dir, fired = tmp_path / "run", tmp_path / "fired"
    fired.mkdir()
    faults = ",".join(f"replica_step:1:{version}" for version in range(STEPS))
    rc, err = run.run_to_the_end(tiny_model_dir, run_dir, *RUN, faults=faults, fired=fired)
    assert rc == 0, err[-3000:]
    assert len(list(fired.iterdir())) == 1, err[-3000:]  # the replica died, once

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(STEPS + 1))  # each step once, none lost
    steps = lines[1:]
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    (lossy,) = [m for m in steps if m.get("replicas_lost")]
    assert list(lossy["replicas_lost"]) == ["1"]
    assert "died" in lossy["replicas_lost"]["1"], lossy["replicas_lost"]
    # rerun by the core ranks alone: no replica's gradients in it, every sample trained
    assert "replicas_joined" not in lossy
    assert all(m["samples_trained"] == PROMPTS * SAMPLES for m in steps)
    after = [m for m in steps if m["step"] >= lossy["step"]]
    assert not any(m.get("replicas_joined") for m in after)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["workers_lost"] == 1
    assert [e["step"] for e in summary["elastic"]["events"] if "lost" in e] == \
        [lossy["step"] - 1]  # the boundary before: the pool's last step when it was lost
    moves = [(t["worker"], t["to_state"], t["reason"].split(":")[0])
             for t in summary["elastic"]["timeline"]]
    assert moves[-1] == (1, "rollout", "lost"), moves  # the move forgotten, not a leave
    assert not any(e.get("failed") for e in summary["elastic"]["events"])
    # rollout worker 1's track (pid 1: rollout): a replica, then its replacement by a new
    # process (whether that one serves before the run's end depends on the machine's speed)
    track = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "X" and (e["pid"], e["tid"]) == (1, 1)]
    (replaced,) = [e for e in track if e["name"] == "replace"]
    assert any(e["name"] == "replica" and e["ts"] < replaced["ts"] for e in track)

    ledger = Ledger.from_dict(json.loads((run_dir / "checkpoint" / "ledger.json").read_text()))
    counts = ledger.fresh_train_counts_by_prompt(0)
    assert sum(counts.values()) == STEPS * PROMPTS and set(counts.values()) <= {0, 1}
    assert summary["ledger"]["generating"] == 0


def _batch(model_dir):
    batch = make_batch(model_dir)
    batch.ref_logprobs = None
    return batch


def _rank(model_dir, rendezvous):
    config = load_config(overrides=["platform=cpu", "train.lr=1e-2", f"model.path={model_dir}",
                                    "cluster.threads_per_worker=1"])
    return trainer_rank.TrainerRank(runtime_settings(config).trainer, 0, 1, rendezvous, model_dir)


def test_a_failed_replica_fetch_leaves_no_gradients_in_the_rerun(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    def lost_replica(refs):
        def fetch():
            raise RuntimeError("the replica's process died")  # what ray.get raised, in short
        return fetch

    outcome = {}
    for name, fails_first in (("fresh", False), ("rerun", True)):
        rank = _rank(tiny_model_dir, f"file://{tmp_path}/{name}")
        try:
            if fails_first:
                with monkeypatch.context() as patched:
                    patched.setattr(trainer_rank, "_replica_gradients", lost_replica)
                    with pytest.raises(RuntimeError, match="process died"):
                        rank.train(_batch(tiny_model_dir), ["replica 1's reference"], 3)
                assert rank.engine.version == 0  # no optimizer step in the failed attempt
            metrics = rank.train(_batch(tiny_model_dir))
            outcome[name] = (metrics, rank.engine.compute_logprobs(_batch(tiny_model_dir)))
        finally:
            rank.engine.close()
    (fresh, fresh_logprobs), (rerun, rerun_logprobs) = outcome["fresh"], outcome["rerun"]
    # the failed attempt's gradients would double the norm (the same batch twice)
    assert rerun["grad_norm"] == fresh["grad_norm"] and rerun["loss"] == fresh["loss"]
    assert torch.equal(rerun_logprobs, fresh_logprobs)  # the same weights after the step

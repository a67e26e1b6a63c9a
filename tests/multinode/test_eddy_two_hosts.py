"""`eddy train` on a two-node Ray cluster (issue 21): hosts A and B with their own networks and
their own /tmp (tests/multinode/hosts.py). The driver runs on A with the model and the run
directory in A's /tmp, which B cannot see: the model reaches B through the object store, the
trainer group and the weights cross the veth, B's checkpoint files come back to A's driver."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eddyrl

WARM_START = Path(eddyrl.__file__).parent / "assets" / "tiny_warmstart"
RUN = ["platform=cpu", "train.num_workers=2", "rollout.num_workers=2",
       "window.max_staleness=1", "cluster.train_strategy=spread",
       "cluster.rollout_strategy=spread", "loop.batch_prompts=8", "rollout.n_samples=4",
       "data.train_size=256", "data.eval_size=100", "loop.eval_every=0",
       "cluster.threads_per_worker=1", "checkpoint.every=2", "model.path=/tmp/model",
       "run_dir=/tmp/work/run"]


def _train(cluster, *overrides: str, check: bool = True):
    a = cluster.hosts.a
    return a.run([sys.executable, "-m", "eddyrl.cli", "train",
                  f"cluster.address={cluster.address}", *RUN, *overrides],
                 env=cluster.env({"EDDY_PLATFORM": "cpu"}), timeout=1500, check=check)


def _ledger(host) -> dict:
    return json.loads(host.path("/tmp/work/run/checkpoint/ledger.json").read_text())


def _wait_for(condition, what: str, timeout: float = 900.0, process=None) -> None:
    """Poll until `condition()`; fail naming `what` (or when `process` ended first)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended (rc {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.5)


@pytest.mark.slow
def test_a_run_across_two_hosts_then_host_b_lost_and_the_resume_on_host_a(ray_cluster_factory,
                                                                          tmp_path):
    """One run, one cluster (each costs tens of seconds on the CI machine):

    1. `eddy train` from host A with the model and the run directory in A's /tmp: one trainer
       rank and one rollout worker land on each host; the model reaches B as data, once, into
       its node cache; B's optimizer shard comes back through the driver into step 2's
       checkpoint; nothing of A's /tmp ever exists on B.
    2. Host B's Ray (raylet and workers: trainer rank 1, rollout worker 1) killed after step
       2's checkpoint: the run ends with one line that names the lost rank and says how to
       resume.
    3. `resume=auto` with one trainer rank and one rollout worker goes on from the newest
       checkpoint on host A alone (the optimizer state resharded 2 -> 1) to the end; held-out
       accuracy is above the warm start's; the ledger across both runs trains no prompt twice
       as fresh."""
    cluster = ray_cluster_factory(num_cpus={"A": 2, "B": 1})
    a, b = cluster.hosts.a, cluster.hosts.b
    shutil.copytree(WARM_START, a.path("/tmp/model"))  # in A's /tmp: B cannot read it
    steps = 8
    log = tmp_path / "first.err"
    with open(log, "w") as err:
        first = a.popen([sys.executable, "-m", "eddyrl.cli", "train",
                         f"cluster.address={cluster.address}", *RUN, f"loop.steps={steps}",
                         "checkpoint.every=1"],
                        env=cluster.env({"EDDY_PLATFORM": "cpu"}), stdout=subprocess.DEVNULL,
                        stderr=err)
    try:
        step_2 = a.path("/tmp/work/run/checkpoints/step_000002")
        _wait_for(step_2.exists, "step 2's checkpoint", process=first)
        placement = json.loads(a.path("/tmp/work/run/placement.json").read_text())
        shards = sorted(p.name for p in (step_2 / "optim").glob("*.safetensors"))
        killed_at = time.monotonic()
        cluster.stop_node(b)
        rc = first.wait(timeout=900)
        ended_s = time.monotonic() - killed_at
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # 1. across the hosts
    placement = placement["placement"]
    assert sorted(placement["trainer"]) == sorted([a.address, b.address]), placement
    assert sorted(placement["rollout"]) == sorted([a.address, b.address]), placement
    assert len(shards) == 2, shards  # both ranks' optimizer shards (B's through the driver)
    (copy,) = [p for p in b.path("/tmp/eddy-node-cache").iterdir()
               if not p.name.startswith(".")]  # beside it: its lock file
    assert (copy / "model.safetensors").read_bytes() == \
        (WARM_START / "model.safetensors").read_bytes()
    assert not b.path("/tmp/model").exists() and not b.path("/tmp/work/run").exists()
    # 2. the loss, in one line
    last = log.read_text().strip().splitlines()[-1]
    assert rc == 2, log.read_text()[-3000:]
    assert last.startswith("eddy: error: trainer rank 1 (node "), last
    assert " was lost during " in last, last
    assert "resume with resume=auto run_dir=/tmp/work/run (its newest good checkpoint is " \
        "step " in last, last
    newest = int(last.rsplit("step ", 1)[1].rstrip(")"))
    assert 2 <= newest < steps

    # 3. the resume, on host A alone
    began = time.monotonic()
    _train(cluster, f"loop.steps={steps}", "resume=auto", "train.num_workers=1",
           "rollout.num_workers=1", "cluster.train_strategy=any",
           "cluster.rollout_strategy=any")
    resumed_s = time.monotonic() - began
    summary = json.loads(a.path("/tmp/work/run/summary.json").read_text())
    assert summary["steps"] == steps and summary["resumed_step"] == newest
    assert summary["placement"] == {"trainer": [a.address], "rollout": [a.address]}
    lines = [json.loads(line) for line in a.path("/tmp/work/run/metrics.jsonl").open()]
    warm_start = lines[0]["eval_accuracy"]  # the first run's step 0, kept by the resume
    assert lines[0]["step"] == 0 and summary["final_eval_accuracy"] > warm_start
    from eddyrl.core.ledger import Ledger

    counts = Ledger.from_dict(_ledger(a)).fresh_train_counts_by_prompt(0)
    assert set(counts.values()) <= {0, 1} and sum(counts.values()) > 0
    print(f"host B killed: the run ended {ended_s:.1f} s later ({last}); the resume from step "
          f"{newest} to {steps} on host A took {resumed_s:.1f} s; held-out accuracy {warm_start:.3f} "
          f"-> {summary['final_eval_accuracy']:.3f}; cluster up in {cluster.startup_s}")


@pytest.mark.slow
def test_host_b_lost_under_a_rollout_worker_the_run_goes_on_on_host_a(ray_cluster_factory):
    """The rollout side of a node loss: the trainer on host A, rollout worker 1 alone on host
    B. Host B's Ray killed while the next batch generates (K = 1): worker 1 is lost, its
    requests go back to the queue and are regenerated on host A, a replacement process starts
    on A (Ray moves its placement-group bundle there), and the run finishes with every group
    trained exactly once as fresh.

    Placement, forced by resources: each actor takes one CPU (`cluster.num_cpus=8` over four
    shares, capped at one); the rollout workers' SPREAD group is reserved first, one bundle a
    host, which fills B's one CPU, so the trainer goes to A; A's third CPU is the
    replacement's."""
    cluster = ray_cluster_factory(num_cpus={"A": 3, "B": 1})
    a, b = cluster.hosts.a, cluster.hosts.b
    shutil.copytree(WARM_START, a.path("/tmp/model"))
    steps = 4
    run = [arg for arg in RUN if not arg.startswith(("train.num_workers", "cluster.train_",
                                                     "checkpoint.every"))]
    first = a.popen([sys.executable, "-m", "eddyrl.cli", "train",
                     f"cluster.address={cluster.address}", *run, "train.num_workers=1",
                     "cluster.train_strategy=any", "cluster.num_cpus=8", f"loop.steps={steps}"],
                    env=cluster.env({"EDDY_PLATFORM": "cpu"}), stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE, text=True)
    metrics = a.path("/tmp/work/run/metrics.jsonl")

    def steps_logged() -> int:
        return len(metrics.read_text().splitlines()) - 1 if metrics.exists() else 0

    try:
        _wait_for(lambda: steps_logged() >= 2, "step 2", process=first)
        placement = json.loads(a.path("/tmp/work/run/placement.json").read_text())["placement"]
        cluster.stop_node(b)  # the step just ended: worker 1 is generating the next batch
        killed_at = time.monotonic()
        _, err = first.communicate(timeout=1200)
        finished_s = time.monotonic() - killed_at
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert placement == {"trainer": [a.address], "rollout": [a.address, b.address]} or \
        placement == {"trainer": [a.address], "rollout": [b.address, a.address]}, placement
    assert first.returncode == 0, err[-3000:]
    summary = json.loads(a.path("/tmp/work/run/summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["workers_lost"] >= 1 and summary["rollout_replacements"] >= 1, summary
    lines = [json.loads(line) for line in metrics.open()]
    regenerated = sum(m.get("regenerated_requests", 0) for m in lines)
    from eddyrl.core.ledger import Ledger

    groups = Ledger.from_dict(_ledger(a)).to_dict()["groups"]
    fresh = [g for g in groups.values()
             if any(h["state"] == "trained_fresh" for h in g["history"])]
    # every group a step kept (equal-reward groups are dropped) was trained fresh, once
    assert len(fresh) == sum(m["groups_kept"] for m in lines[1:]) > 0
    for group in fresh:  # each trained fresh exactly once
        assert [h["state"] for h in group["history"]].count("trained_fresh") == 1
    assert summary["final_eval_accuracy"] > lines[0]["eval_accuracy"]
    print(f"host B killed after step 2: {regenerated} requests regenerated on host A, "
          f"{summary['rollout_replacements']} replacement(s); the run finished {finished_s:.1f}"
          f" s later; cluster up in {cluster.startup_s}")

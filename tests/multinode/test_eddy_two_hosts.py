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


@pytest.mark.slow
def test_a_run_across_two_hosts_trains_with_a_rank_and_a_worker_on_each(ray_cluster_factory):
    cluster = ray_cluster_factory(num_cpus={"A": 1, "B": 1})
    a, b = cluster.hosts.a, cluster.hosts.b
    shutil.copytree(WARM_START, a.path("/tmp/model"))  # in A's /tmp: B cannot read it

    done = _train(cluster, "loop.steps=6")

    summary = json.loads(a.path("/tmp/work/run/summary.json").read_text())
    assert summary["steps"] == 6 and summary["runtime"] == "ray", done.stdout[-2000:]
    # one trainer rank and one rollout worker on each host
    assert sorted(summary["placement"]["trainer"]) == sorted([a.address, b.address])
    assert sorted(summary["placement"]["rollout"]) == sorted([a.address, b.address])
    # the model reached B as data, written once into B's node cache; nothing of A's /tmp
    # (model, run directory) exists on B
    (copy,) = [p for p in b.path("/tmp/eddy-node-cache").iterdir()
               if not p.name.startswith(".")]  # beside it: its lock file
    assert (copy / "model.safetensors").read_bytes() == \
        (WARM_START / "model.safetensors").read_bytes()
    assert not b.path("/tmp/model").exists() and not b.path("/tmp/work/run").exists()
    # learning: held-out accuracy rises from the warm start
    print(f"held-out accuracy {summary['initial_eval_accuracy']:.3f} -> "
          f"{summary['final_eval_accuracy']:.3f}; cluster up in {cluster.startup_s}")
    assert summary["final_eval_accuracy"] > summary["initial_eval_accuracy"]
    # the checkpoints hold both ranks' optimizer shards (B's came back through the driver)
    shards = sorted(p.name for p in a.path("/tmp/work/run/checkpoints/step_000006/optim")
                    .glob("*.safetensors"))
    assert len(shards) == 2, shards
    # exactly once: no prompt trained twice as fresh, every trained group in the ledger (groups
    # with equal rewards are dropped: algorithm.dynamic_sampling)
    from eddyrl.core.ledger import Ledger

    counts = Ledger.from_dict(_ledger(a)).fresh_train_counts_by_prompt(0)
    assert set(counts.values()) <= {0, 1}
    assert sum(counts.values()) * 4 == summary["samples_trained"] > 0


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
def test_losing_host_b_ends_the_run_with_how_to_go_on_and_the_resume_finishes_on_host_a(
        ray_cluster_factory, tmp_path):
    """Host B's Ray (raylet, workers: trainer rank 1, rollout worker 1) killed mid-run: the
    run ends with one line that names the lost rank and says how to resume; `resume=auto`
    with one trainer rank and one rollout worker goes on from the newest checkpoint on host
    A alone, and the ledger across both runs trains no prompt twice as fresh."""
    cluster = ray_cluster_factory(num_cpus={"A": 2, "B": 1})
    a, b = cluster.hosts.a, cluster.hosts.b
    shutil.copytree(WARM_START, a.path("/tmp/model"))
    steps = 8
    log = tmp_path / "first.err"
    with open(log, "w") as err:
        first = a.popen([sys.executable, "-m", "eddyrl.cli", "train",
                         f"cluster.address={cluster.address}", *RUN, f"loop.steps={steps}",
                         "checkpoint.every=1"],
                        env=cluster.env({"EDDY_PLATFORM": "cpu"}), stdout=subprocess.DEVNULL,
                        stderr=err)
    try:
        checkpoint = a.path("/tmp/work/run/checkpoints/step_000002")
        _wait_for(checkpoint.exists, "step 2's checkpoint", process=first)
        killed_at = time.monotonic()
        cluster.stop_node(b)
        rc = first.wait(timeout=900)
        ended_s = time.monotonic() - killed_at
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    last = log.read_text().strip().splitlines()[-1]
    assert rc == 2, log.read_text()[-3000:]
    assert last.startswith("eddy: error: "), last
    assert "resume with resume=auto run_dir=/tmp/work/run (its newest checkpoint is step " \
        in last, last
    newest = int(last.rsplit("step ", 1)[1].rstrip(")"))
    assert 2 <= newest < steps

    began = time.monotonic()
    _train(cluster, f"loop.steps={steps}", "resume=auto", "train.num_workers=1",
           "rollout.num_workers=1", "cluster.train_strategy=any",
           "cluster.rollout_strategy=any")
    resumed_s = time.monotonic() - began
    summary = json.loads(a.path("/tmp/work/run/summary.json").read_text())
    assert summary["steps"] == steps and summary["resumed_step"] == newest
    assert summary["placement"] == {"trainer": [a.address], "rollout": [a.address]}
    from eddyrl.core.ledger import Ledger

    counts = Ledger.from_dict(_ledger(a)).fresh_train_counts_by_prompt(0)
    assert set(counts.values()) <= {0, 1}
    print(f"host B killed: the run ended {ended_s:.1f} s later ({last}); the resume from step "
          f"{newest} to {steps} on host A took {resumed_s:.1f} s")

"""End to end: `eddy train` as a user runs it (the default job runs in one process:
`cluster.runtime` auto is local), and on a local Ray the same loop with two trainer ranks, two
rollout workers and the collective weight channel (gloo on the CPU), the asynchronous modes,
the elastic pool and lost workers."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

SMALL = ["loop.steps=2", "loop.batch_prompts=4", "loop.eval_every=1", "rollout.n_samples=4",
         "rollout.max_new_tokens=24", "data.train_size=64", "data.eval_size=8",
         "cluster.threads_per_worker=1", "data.reward_fn=reward_fixtures:length_reward"]
from tree import SUPPORT_DIR as TESTS  # noqa: E402 (on the runs' PYTHONPATH)
from local_ray import kept_ray  # noqa: E402,F401 (a fixture: one Ray for the runs here)


@pytest.mark.slow
def test_eddy_train_cli_writes_metrics_summary_and_checkpoint(tiny_model_dir, tmp_path):
    # No run_dir, as in the README: the default is relative to the working directory.
    cmd = [sys.executable, "-m", "eddyrl.cli", "train", f"model.path={tiny_model_dir}", *SMALL]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "EDDY_PLATFORM": "cpu",
                              "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    run_dir = runs[0]
    assert out.stdout.strip().splitlines()[-1] == str(run_dir / "summary.json")
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("initial_eval_accuracy", "final_eval_accuracy", "wall_seconds", "steps",
                "samples_trained", "tokens_generated"):
        assert key in summary, key
    assert summary["steps"] == 2 and summary["samples_trained"] == 2 * 4 * 4
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert all("eval_accuracy" in m for m in lines)
    assert lines[-1]["version"] == 2 and lines[-1]["mismatch_abs_max"] < 1e-4
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint")
    assert sum(p.numel() for p in model.parameters()) > 0
    # observability: every worker's activity in trace.json, TensorBoard scalars, eddy report
    from eddyrl.cli import main
    from eddyrl.observability.sinks import summary_writer_class
    from eddyrl.observability.trace import Trace

    trace = json.loads((run_dir / "trace.json").read_text())
    spans = {(e["pid"], e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    rollout, train, driver = Trace.ROLES["rollout"], Trace.ROLES["train"], Trace.ROLES["driver"]
    assert {(rollout, 0, "generate"), (rollout, 0, "weight sync"), (train, 0, "train"),
            (train, 0, "weight sync"), (driver, 0, "reward"), (train, 0, "checkpoint")} <= spans
    assert 0 < trace["otherData"]["duration_s"] <= summary["wall_seconds"]
    if summary_writer_class() is not None:  # the `observe` extra (in `dev`)
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert main(["report", str(run_dir)]) == 0
    assert {p.name for p in (run_dir / "report").glob("*.png")} == \
        {"reward.png", "staleness.png", "idle.png", "timeline.png"}


@pytest.mark.slow
def test_two_ranks_two_workers_collective_channel(tiny_model_dir, tmp_path, kept_ray):
    from eddyrl.config import load_config
    from eddyrl.launch import train

    config = load_config(overrides=[f"model.path={tiny_model_dir}", f"run_dir={tmp_path}",
                                    "platform=cpu", "train.num_workers=2",
                                    "rollout.num_workers=2", "train.weight_channel=collective",
                                    "algorithm.dynamic_sampling=true", *SMALL])
    summary = json.loads(train(config).read_text())
    assert summary["steps"] == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in lines[1:] if not m.get("skipped")]
    assert len(trained) == 2 and all(m["grad_norm"] > 0 for m in trained)
    # after a sync over the channel the workers sample from exactly the trainer's weights
    assert all(m["mismatch_abs_max"] < 1e-4 for m in trained)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(saved[k], start[k]) for k in start)


@pytest.mark.slow
def test_bounded_staleness_with_replay_on_ray(tiny_model_dir, tmp_path, kept_ray):
    """A real asynchronous run (K = 1, replay, two rollout workers): staleness stays within K,
    every trajectory is on one version, and the ledger accounts for every group."""
    from eddyrl.config import load_config
    from eddyrl.core.ledger import Ledger
    from eddyrl.launch import train

    config = load_config(overrides=[
        f"model.path={tiny_model_dir}", f"run_dir={tmp_path}", "platform=cpu",
        "cluster.runtime=ray", "rollout.num_workers=2", "window.max_staleness=1",
        "algorithm.decoupled=true",
        "algorithm.tis_cap=2.0", "algorithm.dynamic_sampling=false", "replay.max_fraction=0.5",
        "replay.max_lag=2", *SMALL, "loop.steps=4"])
    summary = json.loads(train(config).read_text())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = lines[1:]
    assert [m["staleness_max"] for m in steps][1:] == [1, 1, 1]  # the pipeline runs ahead
    assert all(m["staleness_max"] <= 1 for m in steps)  # C3
    assert all(m["groups_kept"] == 2 for m in steps)  # (1 - 0.5) * 4 fresh groups per step
    assert [m["replay_samples"] for m in steps][1:] == [8, 8, 8]  # 2 replayed groups x 4
    ledger = Ledger.from_dict(json.loads((tmp_path / "checkpoint" / "ledger.json").read_text()))
    trained = {i: n for i, n in ledger.fresh_train_counts_by_prompt(0).items() if n}
    assert len(trained) == 8 and set(trained.values()) == {1}
    assert summary["ledger"]["trained_fresh"] + summary["ledger"]["in_replay"] + \
        summary["ledger"]["evicted"] + summary["ledger"]["done"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("mode_name", ["multiversion", "bucket"])
def test_multiversion_mode_on_ray(tiny_model_dir, tmp_path, mode_name, kept_ray):
    """modes/multiversion (eddyrl/configs/modes/multiversion.yaml) (DORA, K = 3) on two Ray
    rollout workers, and modes/bucket (Libra's bucket router over a short and a long worker, on
    the one-step pipeline, K = 1): the
    pipeline runs up to K versions ahead and never beyond, every group ends in a final or
    collected state (none left generating or queued: C2), and no prompt is trained twice as
    fresh."""
    from eddyrl.config import bundled, load_config
    from eddyrl.core.ledger import Ledger
    from eddyrl.launch import train

    mode = bundled(f"modes/{mode_name}")
    config = load_config(mode, overrides=[
        f"model.path={tiny_model_dir}", f"run_dir={tmp_path}", "platform=cpu",
        "cluster.runtime=ray", "rollout.num_workers=2", "algorithm.dynamic_sampling=false",
        *SMALL, "loop.steps=6", "loop.eval_every=0", "routing.min_observations=2",
        "routing.rebuild_every=2", "routing.milestones=[4,8]",
        "routing.buckets=[{name: short, max_tokens: 8}, {name: long, max_tokens: 24}]"])
    summary = json.loads(train(config).read_text())
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(steps) == 6 and all(m["groups_kept"] == 4 for m in steps)
    assert max(m["staleness_max"] for m in steps) <= 3  # C3
    assert max(m["staleness_max"] for m in steps) >= 1  # it did run ahead
    assert summary["ledger"]["generating"] == 0 and summary["ledger"]["queued"] == 0
    ledger = Ledger.from_dict(json.loads((tmp_path / "checkpoint" / "ledger.json").read_text()))
    counts = ledger.fresh_train_counts_by_prompt(0)
    assert sum(counts.values()) == 6 * 4 and set(counts.values()) <= {0, 1}
    if mode_name == "bucket":  # routed by prediction; the moves depend on the lengths drawn
        routing = summary["routing"]
        assert routing["policy"] == "bucket"
        # the engines' milestone reports reached the router through Ray, and it predicted
        assert routing["predictions"]["prompt"] + routing["predictions"]["global"] > 0
        # moves happen when a prediction says "long" (lengths are sampled); those made during
        # steps are counted per step, the rest while draining
        assert routing["moves"] >= sum(m["routed_requests"] for m in steps)


def test_train_refuses_a_run_dir_that_holds_a_run(tmp_path):
    """Appending would mix two runs' metrics and overwriting would lose one: refuse, by name."""
    from eddyrl.config import load_config
    from eddyrl.errors import ConfigError
    from eddyrl.launch import train

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    config = load_config(overrides=[f"run_dir={tmp_path}", "platform=cpu"])
    with pytest.raises(ConfigError, match=f"run_dir '{tmp_path}' already holds a run"):
        train(config)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'


@pytest.mark.slow
def test_elastic_pool_lends_a_rollout_worker_to_training_and_back(tiny_model_dir, tmp_path):
    """Libra's non-blocking migration for real (Ray actors, gloo, CPU): rollout worker 1 joins
    training after step 2 and leaves after step 7, with the adaptive scheduler and the bucket
    router (worker 0 short, worker 1 long) also on. The trainer takes a step every step
    throughout; the replica's gradients count while it is joined; the worker serves rollout
    again at the end; C3 and the ledger hold; while the long bucket's worker is lent, no
    request is routed to it."""
    from eddyrl.config import load_config
    from eddyrl.core.ledger import Ledger
    from eddyrl.launch import train

    config = load_config(overrides=[
        f"model.path={tiny_model_dir}", f"run_dir={tmp_path}", "platform=cpu",
        "cluster.runtime=ray", "rollout.num_workers=2", "window.max_staleness=1",
        "algorithm.decoupled=true",
        "algorithm.dynamic_sampling=false", "elastic.enabled=true",
        'elastic.schedule=["2 join 1", "7 leave 1"]', "adaptive.enabled=true",
        "adaptive.window=2", "adaptive.cooldown_steps=2", *SMALL, "loop.steps=10",
        "loop.eval_every=0", "routing.policy=bucket", "routing.min_observations=2",
        "routing.rebuild_every=2", "routing.milestones=[4,8]",
        "routing.buckets=[{name: short, max_tokens: 8}, {name: long, max_tokens: 24}]"])
    summary = json.loads(train(config).read_text())
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["version"] for m in steps] == list(range(1, 11))  # training never paused
    joined = [m["step"] for m in steps if m.get("replicas_joined")]
    assert joined and min(joined) >= 4, joined  # joins after 2: sleeps, fetches, activates
    assert all(m["samples_trained"] == 4 * 4 for m in steps)  # no sample lost to the split
    # The migration's only cost on the critical path: the driver at each boundary. Measured
    # here at a few milliseconds; 0.5 s leaves room for a loaded CI machine.
    assert max(m["elastic_s"] for m in steps) < 0.5
    moves = [(t["worker"], t["to_state"]) for t in summary["elastic"]["timeline"]]
    for state in ("requested", "fetching_state", "zero_sync", "activating", "active",
                  "releasing", "loading_weights", "rollout"):
        assert (1, state) in moves, state
    # back in rollout at the end, unless the adaptive scheduler (on here) borrowed it again
    # after the scheduled leave, which timing decides
    reborrowed = any(e.get("decision") == "borrow" and e["step"] > 7
                     for e in summary["elastic"]["events"])
    assert steps[-1].get("elastic_states", {}).get("1") in (None, "rollout") or reborrowed
    assert max(m["staleness_max"] for m in steps) <= 1  # C3
    ledger = Ledger.from_dict(json.loads((tmp_path / "checkpoint" / "ledger.json").read_text()))
    counts = ledger.fresh_train_counts_by_prompt(0)
    assert sum(counts.values()) == 10 * 4 and set(counts.values()) <= {0, 1}
    assert summary["ledger"]["generating"] == 0
    assert summary["routing"]["predictions"]["none"] < sum(summary["routing"]["predictions"]
                                                          .values())
    lent = [m.get("elastic_states", {}).get("1") not in (None, "rollout") for m in steps]
    # a step that began with the worker already lent routed nothing to it (in the step where
    # a lend starts, requests were routed before it)
    assert all(m["routed_requests"] == 0 for m, now, before in zip(steps[1:], lent[1:], lent)
               if now and before)
    # the trace shows worker 1's time lent to training on its own track (rollout pid 1)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {"join", "replica", "leave"} <= {e["name"] for e in events
                                            if e["ph"] == "X" and (e["pid"], e["tid"]) == (1, 1)}


@pytest.mark.slow
def test_eddy_train_with_the_vllm_engine_raises_held_out_accuracy(tmp_path):
    """`eddy train rollout.engine=vllm` on the bundled tiny default (warm-started model,
    arithmetic task): the run completes with vLLM's CPU engine (in the driver: the default job
    runs in one process; vLLM's engine core is its own process), the trainer's log-probs
    agree with vLLM's, and held-out accuracy rises (0.258 -> 0.69 in 10 steps when measured)."""
    pytest.importorskip("vllm")
    cmd = [sys.executable, "-m", "eddyrl.cli", "train", "rollout.engine=vllm",
           "loop.steps=10", "loop.eval_every=10", f"run_dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                         env={**os.environ, "EDDY_PLATFORM": "cpu"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 10
    assert summary["final_eval_accuracy"] > summary["initial_eval_accuracy"] + 0.15
    lines = [json.loads(line) for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(m["mismatch_abs_max"] for m in lines if m["step"]) < 1e-4


@pytest.mark.slow
def test_colocated_roles_take_turns_on_shared_devices(tiny_model_dir, tmp_path, kept_ray):
    """Two devices, each holding a rollout worker and a trainer rank (one Ray placement-group
    bundle each): the engines sleep while the trainers train, the trainers' state goes to host
    memory while the engines generate, and the weights still reach the engines exactly."""
    from eddyrl.config import load_config
    from eddyrl.launch import train

    config = load_config(overrides=[f"model.path={tiny_model_dir}", f"run_dir={tmp_path}",
                                    "platform=cpu", "cluster.placement=colocated",
                                    "train.num_workers=2", "rollout.num_workers=2", *SMALL])
    summary = json.loads(train(config).read_text())
    assert summary["steps"] == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m["step"] > 0]
    assert all(m["switch_s"] > 0 for m in steps)  # every step handed the devices over
    assert all(m["mismatch_abs_max"] < 1e-4 for m in steps)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(saved[k], start[k]) for k in start)


def test_colocated_placement_refuses_what_it_cannot_time_share():
    from eddyrl.config import load_config
    from eddyrl.errors import ConfigError

    for extra, named in [(["window.max_staleness=1"], "max_staleness = 1"),
                         (["elastic.enabled=true", "rollout.num_workers=2"], "elastic.enabled"),
                         (["rollout.platform=cpu", "train.platform=cuda"], "'cuda'")]:
        with pytest.raises(ConfigError, match=named):
            load_config(overrides=["cluster.placement=colocated", *extra])
    with pytest.raises(ConfigError, match="cluster.placement"):
        load_config(overrides=["cluster.placement=shared"])


def test_a_split_placement_on_too_few_devices_says_so(monkeypatch):
    """One GPU for a rollout worker and a trainer rank: an error naming the shortfall and the
    colocated way out, instead of actors waiting forever (the check's logic; the resource
    count is Ray's on a real machine)."""
    import ray

    from eddyrl.config import load_config
    from eddyrl.errors import ConfigError
    from eddyrl.runtime.ray.placement import check_split_devices

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    from eddyrl.resolved import runtime_settings

    settings = runtime_settings(load_config(overrides=["platform=cpu"]))
    with pytest.raises(ConfigError, match=r"2 in all; this machine has 1\..*colocated"):
        check_split_devices(settings, {"train": "cuda", "rollout": "cuda"})
    check_split_devices(settings, {"train": "cpu", "rollout": "cpu"})  # CPU: no device count


@pytest.mark.slow
def test_killing_a_rollout_worker_three_times_loses_nothing(tiny_model_dir, tmp_path, kept_ray):
    """Fault injection on a local Ray: after a step, rollout worker 0's process is killed (the
    next batch is generating: K = 1), three processes in all, one after another. Its requests
    are regenerated on the other worker, a replacement is started each time, the run finishes,
    and the ledger shows every group of the run trained exactly once as fresh, none lost.

    A kill waits for a step at whose end a live process of worker 0 exists: the last one's loss
    is noticed when the rollout next calls it, and on a busy machine that can be a step later
    (the callback runs on the run's event loop, so it cannot wait for the replacement)."""
    import ray

    from eddyrl.config import load_config
    from eddyrl.core.ledger import Ledger
    from eddyrl.launch import train

    killed = []
    steps = 7  # room for three kills, whichever steps they land on

    def kill_worker_0(metrics):
        if len(killed) < 3 and 1 <= metrics["step"] <= steps - 2:
            # the newest process of worker 0, once it has started (a replacement may still be
            # loading its model: waiting for it here does not wait on the run's event loop)
            live = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(True)
                    if a["name"].startswith("rollout-0.") and a["name"] not in killed]
            if not live:
                return  # the last kill is not noticed yet: no replacement started
            name, namespace = max(live, key=lambda a: int(a[0].rsplit(".", 1)[1]))
            actor = ray.get_actor(name, namespace=namespace)
            ray.get(actor.stats.remote(), timeout=120)
            ray.kill(actor, no_restart=True)
            killed.append(name)

    config = load_config(overrides=[
        f"model.path={tiny_model_dir}", f"run_dir={tmp_path}", "platform=cpu",
        "cluster.runtime=ray", "rollout.num_workers=2", "window.max_staleness=1", *SMALL,
        f"loop.steps={steps}",
        "loop.eval_every=0"])
    summary = json.loads(train(config, on_step=kill_worker_0).read_text())
    assert summary["steps"] == steps
    assert len(set(killed)) == 3  # three processes of worker 0 killed, one after another
    # each kill is noticed by the rollout (requests back, a replacement started) or, when it
    # hit a replacement before it took work, by the replacement's own retry
    assert summary["workers_lost"] >= 1 and summary["rollout_replacements"] >= 3
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(m.get("regenerated_requests", 0) for m in lines) > 0
    ledger = Ledger.from_dict(json.loads((tmp_path / "checkpoint" / "ledger.json").read_text()))
    groups = ledger.to_dict()["groups"]
    fresh = [g for g in groups.values()
             if any(h["state"] == "trained_fresh" for h in g["history"])]
    # every step's batch: its groups trained, or dropped for having no signal (equal rewards:
    # by chance, more likely where the regenerated samples come out alike; seen under load)
    no_signal = [g for g in groups.values() if any(
        h["state"] == "evicted" and "no learning signal" in (h.get("reason") or "")
        for h in g["history"])]
    assert len(fresh) + len(no_signal) == steps * 4, (len(fresh), len(no_signal))
    assert sum(m.get("samples_trained", 0) for m in lines) == len(fresh) * 4
    for group in fresh:  # each trained fresh exactly once
        assert [h["state"] for h in group["history"]].count("trained_fresh") == 1
    assert any(any("lost" in (h.get("reason") or "") for h in g["history"])
               for g in groups.values())
    report = ledger.check_exactly_once([g["prompt_index"] for g in fresh], epoch=0)
    assert not report.missing and not report.duplicated
    # the trace draws each replacement on the lost worker's own track (rollout pid 1)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e["name"] == "replace" and (e["pid"], e["tid"]) == (1, 0) for e in events
               if e["ph"] == "X")

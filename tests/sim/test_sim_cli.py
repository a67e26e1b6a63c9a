"""`eddy sim` and `eddy bench sim` on small scenarios, and the policy settings."""

import json

import pytest

from eddyrl.cli import main
from eddyrl.runtime.sim_policies import POLICIES, policy_config

SMALL = ["sim.rollout.devices=4", "sim.train.devices=2", "rollout.num_workers=4",
         "loop.steps=2", "loop.batch_prompts=16", "rollout.n_samples=4",
         "sim.workload.max_response_tokens=8000", "sim.workload.eval_prompts=4"]


def test_every_bundled_scenario_loads_and_names_a_cluster():
    from pathlib import Path

    from eddyrl.config import load_config

    folder = Path(__file__).resolve().parents[2] / "configs" / "sim"
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    assert {"dora_64", "asyncflow_910b", "libra_48", "reflow_8", "mixed_vendor",
            "scale_1024"} <= set(names)
    for name in names:
        config = load_config(folder / f"{name}.yaml")
        assert config.rollout.num_workers == config.sim.rollout.groups, name


def test_eddy_sim_runs_a_scenario_by_name(capsys):
    assert main(["sim", "reflow_8", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "step 2:" in out and "rollout idle" in out and "control plane" in out


def test_an_unknown_scenario_lists_the_known_ones(capsys):
    assert main(["sim", "nope"]) == 2
    assert "scenarios: [" in capsys.readouterr().err


def test_policies_set_every_dimension_whatever_the_scenario_chose():
    sync = policy_config("configs/sim/libra_48.yaml", [], "sync")  # the scenario routes
    assert sync.routing.policy == "none" and sync.algorithm.max_staleness == 0
    everything = policy_config("configs/sim/libra_48.yaml", [], "all")
    assert everything.routing.policy == "bucket" and everything.replay.max_fraction == 0.25
    assert sum(b.workers for b in everything.routing.buckets) == 16
    with pytest.raises(Exception, match="unknown policy 'fast'"):
        policy_config(None, [], "fast")


def test_bench_sim_compares_policies_side_by_side(tmp_path, capsys):
    assert main(["bench", "sim", "reflow_8", *SMALL, "--policies", "sync,one_step,all",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| sync |" in out and "| all |" in out
    rows = json.loads((tmp_path / "results.json").read_text())["policies"]
    assert rows["sync"]["speedup"] == 1.0 and rows["sync"]["staleness_max"] == 0
    assert rows["one_step"]["staleness_max"] <= 1 and rows["all"]["staleness_max"] <= 3
    assert set(POLICIES) >= set(rows)


def test_eddy_sim_writes_a_perfetto_trace_of_every_worker(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["sim", "reflow_8", *SMALL, "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    rollout = {e["tid"] for e in spans if e["pid"] == 1}
    assert rollout == {0, 1, 2, 3}  # every instance decoded
    assert {e["name"] for e in spans if e["pid"] == 2} == {"train", "weight sync"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    # a worker's spans never overlap: busy intervals of one engine are sequential
    for worker in rollout:
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                      if e["pid"] == 1 and e["tid"] == worker)
        assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(mine, mine[1:]))

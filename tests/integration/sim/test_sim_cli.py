"""`eddy sim` and `eddy bench sim` on small scenarios, and the policy settings."""

import json

import pytest

from eddyrl.cli import main
from eddyrl.sim.policies import POLICIES, policy_config

SMALL = ["sim.rollout.devices=4", "sim.train.devices=2", "rollout.num_workers=4",
         "loop.steps=2", "loop.batch_prompts=16", "rollout.n_samples=4",
         "sim.workload.max_response_tokens=8000", "sim.workload.eval_prompts=4"]


def test_every_bundled_scenario_loads_and_names_a_cluster():
    from eddyrl.config import bundled_root
    from eddyrl.sim.config import load_scenario as load_config

    folder = bundled_root() / "sim"
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    assert {"dora_64", "asyncflow_910b", "libra_48", "reflow_8", "mixed_vendor",
            "scale_1024"} <= set(names)
    from eddyrl.sim.runtime import instance_tps

    for name in names:
        config = load_config(folder / f"{name}.yaml")
        # one rollout worker per instance; the instances use exactly the rollout devices
        assert config.rollout.num_workers == len(instance_tps(config)), name


def test_eddy_sim_runs_a_scenario_by_name(capsys):
    assert main(["sim", "reflow_8", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "step 2:" in out and "rollout idle" in out and "control plane" in out


def test_an_unknown_scenario_lists_the_known_ones(capsys):
    assert main(["sim", "nope"]) == 2
    assert "scenarios: [" in capsys.readouterr().err


def test_policies_set_every_dimension_whatever_the_scenario_chose():
    sync = policy_config("sim/libra_48", [], "sync")  # the scenario routes
    assert sync.routing.policy == "none" and sync.window.max_staleness == 0
    everything = policy_config("sim/libra_48", [], "all")
    assert everything.routing.policy == "bucket" and everything.replay.max_fraction == 0.25
    # its 32 rollout devices, as the policy lays them out: long instances twice as wide
    assert sum(b.workers * (b.parallelism or everything.sim.rollout.tp)
               for b in everything.routing.buckets) == everything.sim.rollout.devices == 32
    assert everything.routing.buckets[-1].parallelism == 2 * everything.sim.rollout.tp
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
    for policy in rows:  # a Perfetto / Chrome trace each, with every worker's busy intervals
        events = json.loads((tmp_path / f"trace_{policy}.json").read_text())["traceEvents"]
        assert any(e.get("name") == "decode" for e in events), policy
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the observe extra is not installed: no PNG, said so
        assert "no plots" in out
    else:
        for name in ("policies.png", "timeline_sync.png", "timeline_all.png"):
            assert (tmp_path / name).stat().st_size > 1000


def test_the_timeline_shows_a_worker_lent_to_training(tmp_path):
    """The elastic pool's role changes are on the lent worker's own track: its cold start
    each way and its time as a training replica."""
    from eddyrl.sim.config import load_scenario as load_config
    from eddyrl.sim.runtime import Timeline, build
    from eddyrl.sim.clock import run_virtual

    timeline = Timeline()
    config = load_config("sim/reflow_8", [
        *SMALL, "loop.steps=8", "elastic.enabled=true",
        "elastic.schedule=['2 join 3', '5 leave 3']"])
    controller, runtime = build(config, timeline=timeline)
    run_virtual(controller.run())
    lent = [(e["name"], e["tid"]) for e in timeline.events if e["pid"] == 1
            and e["name"] in ("join", "replica", "leave")]
    assert lent == [("join", 3), ("replica", 3), ("leave", 3)]
    pytest.importorskip("matplotlib")
    timeline.plot(str(tmp_path / "t.png"), "elastic")
    assert (tmp_path / "t.png").stat().st_size > 1000


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


def test_overrides_may_follow_the_options(tmp_path, capsys):
    """`eddy bench sim <scenario> --policies ... key=value`: the overrides after an option count
    as much as those before it; anything else there is still refused by name."""
    assert main(["bench", "sim", "reflow_8", "--policies", "sync", *SMALL]) == 0
    assert "| sync |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "sim", "reflow_8", "--policies", "sync", "--nope"])
    assert "unrecognized arguments: --nope" in capsys.readouterr().err

"""`eddy sim`: a cluster run simulated on a scenario, a line per step; `eddy bench sim`: the
policies side by side on one scenario, as a table (and plots, traces, results.json)."""

from __future__ import annotations

import argparse
import json
import sys

from .cli_config import scenario_path, split_config_args


def cmd_sim(ns: argparse.Namespace) -> int:
    from .sim.config import load_scenario
    from .sim.runtime import simulate
    from .ui import console

    path, overrides = split_config_args(ns.args)
    config = load_scenario(scenario_path(path), overrides)
    summary = simulate(config, log=lambda m: console.print(_step_line(m), highlight=False),
                       trace_path=ns.trace)
    console.print(f"simulated {summary['simulated_s']:.1f} s in {summary['wall_s']:.2f} s "
                  f"wall ({summary['rollout_instances']} rollout instances, "
                  f"{summary['train_groups']} trainer groups): rollout idle "
                  f"{summary['rollout_idle']:.1%}, trainer idle {summary['train_idle']:.1%}, "
                  f"control plane {summary['cpu_per_step_fraction']:.2%} of simulated time",
                  highlight=False)
    if summary["tool_calls"]:
        console.print(f"tool calls {summary['tool_calls']} ({summary['tool_failures']} failed), "
                      f"{summary['tool_wait_s']:.0f} s waited in all", highlight=False)
    return 0


def _step_line(m: dict) -> str:
    if not m.get("step"):
        return "step 0 (evaluation)"
    return (f"step {m['step']}: {m['step_s']:.1f} s (rollout wait {m['rollout_s']:.1f}, train "
            f"{m['train_s']:.1f}, sync {m['sync_s']:.2f}), {m['tokens_per_s']:.0f} tokens/s, "
            f"staleness max {m['staleness_max']}")


def cmd_bench_sim(ns: argparse.Namespace) -> int:
    import platform as host
    from pathlib import Path

    from .sim.policies import compare

    path, overrides = split_config_args(ns.args)
    scenario = scenario_path(path)
    policies = ns.policies.split(",")
    print(f"# eddy bench sim {scenario} {' '.join(overrides)} on {host.node()} "
          f"(python {sys.version.split()[0]}); policies {policies}", flush=True)
    plots = False
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        try:
            import matplotlib  # noqa: F401

            plots = True
        except ImportError:
            print("# no plots: pip install 'eddyrl[observe]' for matplotlib")
    rows = compare(scenario, overrides, policies,
                   on_done=lambda p, r: print(f"# {p}: {r['wall_s']:.1f} s wall", flush=True),
                   out=ns.out, plots=plots)
    print("# steady steps (all but the first, which fills the pipeline); speedup: trained "
          "samples/s against the faster synchronous baseline run (sync or colocated); "
          "device_idle: over all the cluster's devices", flush=True)
    columns = ["step_s", "tokens_per_s", "samples_per_s", "speedup", "devices", "device_idle",
               "rollout_idle", "train_idle",
               "staleness_mean", "staleness_max", "replay_fraction", "migrated",
               "cpu_per_step_s", "cpu_fraction"]
    print("| policy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for policy, values in rows.items():
        cells = ["-" if values[c] is None else
                 (f"{values[c]:.3g}" if isinstance(values[c], float) else str(values[c]))
                 for c in columns]
        print(f"| {policy} | " + " | ".join(cells) + " |")
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(
            {"scenario": scenario, "overrides": overrides, "policies": rows}, indent=2))
        print(f"# wrote {out / 'results.json'}")
        if plots:
            from .sim.policies import plot

            plot(rows, str(out / "policies.png"), f"{Path(scenario).stem} (simulated)")
            print(f"# wrote {out / 'policies.png'} and a timeline_<policy>.png per policy")
        print(f"# wrote a Perfetto / Chrome trace per policy: {out}/trace_<policy>.json")
    return 0

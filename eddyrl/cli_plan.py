"""`eddy plan`: a run's predicted memory per role and device (plan/memory_plan.py), or with
`--cluster` the simulator's search over modes and layouts on a scenario (plan/cluster.py)."""

from __future__ import annotations

import argparse
import json
import sys

from .cli_config import scenario_path, split_config_args


def cmd_plan(ns: argparse.Namespace) -> int:
    """The run's predicted memory per role and device; exit status 1 when it does not fit."""
    from .config import load_config
    from .plan.memory_plan import plan_memory
    from .plan.report import format_plan, plan_dict

    if ns.cluster is not None:
        return _plan_cluster(ns)
    path, overrides = split_config_args(ns.args)
    config = load_config(path, overrides, check_files=False)  # a recipe plans without weights
    plan = plan_memory(config, ns.device)
    print(json.dumps(plan_dict(plan), indent=2) if ns.json else format_plan(plan))
    return 0 if plan.fits else 1


def _plan_cluster(ns: argparse.Namespace) -> int:
    """`eddy plan --cluster SCENARIO [key=value ...]`: the simulator's search; exit status 1
    when no candidate could run."""
    from .plan.cluster import format_cluster_plan, plan_cluster

    if ns.device is not None:
        print("eddy: error: --device and --cluster: the scenario names its devices "
              "(sim.rollout.accelerator, sim.train.accelerator)", file=sys.stderr)
        return 2
    plan = plan_cluster(scenario_path(ns.cluster), list(ns.args), ns.budget, ns.steps, ns.top)
    print(json.dumps(plan, indent=2) if ns.json else format_cluster_plan(plan))
    return 0 if plan["choices"] else 1

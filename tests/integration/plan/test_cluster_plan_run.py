"""`eddy plan --cluster` run for real on the smallest bundled scenario: every registry mode at
the default split and one more run, the first choice at least as fast as the best of them
(the search on a stub: test_cluster_plan.py)."""

import json
import subprocess
import sys

from eddyrl.modes import MODES as MODE_REGISTRY


def test_eddy_plan_cluster_on_the_smallest_scenario():
    """reflow_8 (8 devices), every mode and one more run of 2 steps: about 35 s of CPU."""
    budget = len(MODE_REGISTRY) + 1
    done = subprocess.run([sys.executable, "-m", "eddyrl.cli", "plan", "--cluster", "reflow_8",
                           "--budget", str(budget), "--steps", "2", "--top", "3", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["runs"] <= budget and plan["default_split"] == "4:4"
    assert f"[modes 1/{budget}] sync 4:4" in done.stderr
    assert {o["mode"] for o in plan["evaluated"] if o["stage"] == "modes"} == set(MODE_REGISTRY)
    first, base = plan["choices"][0], plan["baseline"]
    assert base["split"] == "4:4" and base["stage"] == "modes"
    assert first["samples_per_s"] >= base["samples_per_s"]
    for key in ("mode", "split", "step_s", "samples_per_s", "device_idle", "memory",
                "settings"):
        assert key in first
    assert first["memory"]["planned"] in (True, False)
    assert len(plan["choices"]) == 3



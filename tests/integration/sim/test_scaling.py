"""The fidelity scenarios on half and twice their cluster (issue 35 checks held-back rows
there): each runs 2 steps without a stall at both scales, and, for a fixed workload, more
devices never make the predicted training phase slower.

Per scenario, the cheapest rows to simulate that cover a split asynchronous policy, partial
rollout and a synchronous baseline; `bench/sim_fidelity.py --scale 0.5,1,2` runs every row.
The physics check is made where the batch is the same at both scales (the groups each step
trains are those dispatched in order before it, their lengths seeded by request id: K = 0, and
one_step's one batch in flight), which the test asserts before comparing. The scaling is
bench/sim_fidelity.py's (`scale_overrides`: eddyrl/sim/scale.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from eddyrl.sim.policies import policy_config
from eddyrl.sim.runtime import simulate

BENCH = Path(__file__).resolve().parents[3] / "bench" / "sim_fidelity.py"
# short runs warn that K >= loop.steps bounds nothing more; beside the point here
pytestmark = pytest.mark.filterwarnings("ignore:window.max_staleness")

# scenario -> its rows checked here, each with whether its batches are the same at every scale
CHECKED = {"dora_64": {"dora_64/one_step": True},
           "verl_7b_64": {"verl_7b_64/colocated": True, "verl_7b_64/fully_async": False},
           "areal_1p5b_128": {"areal_1p5b_128/sync": True}}
SCALES = (0.5, 2.0)
# the training phase is arithmetic on the same rows (no sampling): equal up to float rounding
RESOLUTION = 1e-9


def _bench():
    spec = importlib.util.spec_from_file_location("sim_fidelity", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fidelity = _bench()
ROWS = {row.id: row for row in fidelity.ROWS}


def _run(row_id: str, scale: float) -> tuple[object, list[dict]]:
    row = ROWS[row_id]
    config = policy_config(row.scenario, [*row.overrides, *fidelity.scale_overrides(row, scale),
                                          "loop.steps=2"], row.policy)
    steps = [m for m in simulate(config)["history"] if m.get("step", 0) > 0]
    return config, steps


def test_every_fidelity_scenario_is_checked():
    assert {row.scenario for row in fidelity.ROWS} == set(CHECKED)
    assert all(ROWS[row_id].scenario == scenario
               for scenario, rows in CHECKED.items() for row_id in rows)


@pytest.mark.parametrize("scenario", sorted(CHECKED))
def test_half_and_twice_the_cluster_run_and_training_scales_by_physics(scenario):
    for row_id, fixed_batch in CHECKED[scenario].items():
        runs = {scale: _run(row_id, scale) for scale in SCALES}
        for scale, (config, steps) in runs.items():
            assert [m["step"] for m in steps] == [1, 2], (row_id, scale)  # no stall
            assert all(m["samples_trained"] > 0 for m in steps), (row_id, scale)
        (small, small_steps), (large, large_steps) = runs[0.5], runs[2.0]
        assert large.sim.train.devices == 4 * small.sim.train.devices
        if not fixed_batch:
            continue
        for few, many in zip(small_steps, large_steps):
            assert few["train_tokens"] == many["train_tokens"], row_id  # a fixed workload
            assert many["train_step_s"] <= few["train_step_s"] * (1 + RESOLUTION), row_id

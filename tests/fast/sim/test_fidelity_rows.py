"""bench/sim_fidelity.py's table of published rows: each row cites its source, names a bundled
scenario and a policy that exist, loads with its overrides, and every table has one baseline.
(Nothing is simulated here: how close the predictions come is the bench's to report.)"""

import importlib.util
import sys
from pathlib import Path

import pytest

from eddyrl.sim.config import load_scenario
from eddyrl.sim.policies import POLICIES, policy_config

BENCH = Path(__file__).resolve().parents[3] / "bench" / "sim_fidelity.py"
# the rows load with a short loop.steps, which K >= loop.steps warns about; beside the point here
pytestmark = pytest.mark.filterwarnings("ignore:window.max_staleness")


def _bench():
    spec = importlib.util.spec_from_file_location("sim_fidelity", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fidelity = _bench()


def test_row_ids_are_unique_and_every_table_has_one_baseline():
    ids = [row.id for row in fidelity.ROWS]
    assert len(ids) == len(set(ids))
    tables = {row.table for row in fidelity.ROWS}
    for table in tables:
        assert sum(r.baseline for r in fidelity.ROWS if r.table == table) == 1, table


@pytest.mark.parametrize("row", fidelity.ROWS, ids=lambda r: r.id)
def test_every_row_cites_a_source_and_names_a_scenario_and_policy(row):
    assert row.source.strip() and row.published_step_s > 0
    assert row.policy in POLICIES
    config = policy_config(row.scenario, [*row.overrides, "loop.steps=2"], row.policy)
    assert config.sim.model  # the scenario and its overrides load and validate


def test_the_scenarios_cite_where_their_numbers_come_from():
    folder = Path(__file__).resolve().parents[3] / "eddyrl" / "configs" / "sim"
    for name in {row.scenario for row in fidelity.ROWS}:
        text = (folder / f"{name}.yaml").read_text()
        assert text.startswith("#") and ("paper" in text or "/" in text.splitlines()[0]), name


def test_rows_select_by_pattern_and_refuse_a_pattern_matching_nothing():
    assert [r.id for r in fidelity.select("verl_7b_128/*")] == [
        "verl_7b_128/colocated", "verl_7b_128/fully_async"]
    assert len(fidelity.select(None)) == len(fidelity.ROWS)
    with pytest.raises(SystemExit, match="matches no row"):
        fidelity.select("nothing/*")


def test_report_works_out_error_speedup_and_ranking():
    rows = [fidelity.Row("t", "sync", "dora_64", "colocated", 100.0, "s", baseline=True),
            fidelity.Row("t", "fast", "dora_64", "partial", 50.0, "s")]
    results = [fidelity.Result(rows[0], 110.0, 0.0, {"fits": True}),
               fidelity.Result(rows[1], 40.0, 0.0, {"fits": False})]
    assert results[0].error == pytest.approx(0.10) and results[1].error == pytest.approx(-0.20)
    speedups = fidelity._speedups(results)
    assert speedups["t/fast"] == (pytest.approx(110 / 40), pytest.approx(2.0))
    assert fidelity.rankings(results)["t"]["matches"]
    out = fidelity.report(results)
    assert "| t/fast | partial | 40.0 | 50.0 | -20.0% | NO | 2.75 | 2.00 | NO |" in out
    assert "| t/sync | colocated | 110.0 | 100.0 | +10.0% | yes | 1.00 | 1.00 | yes |" in out
    assert "rows within 15%: 1 of 2" in out


def test_the_verl_scenario_reaches_the_other_cluster_sizes_by_its_device_counts():
    for per_role in (16, 32, 64):
        sizes = [f"sim.rollout.devices={per_role}", f"sim.train.devices={per_role}"]
        partial = policy_config("verl_7b_64", sizes, "partial")
        colocated = policy_config("verl_7b_64", sizes, "colocated")
        assert colocated.sim.rollout.devices == colocated.sim.train.devices == 2 * per_role
        # verl's bound: 1.5 x 512 started per sync, 16 prompts generating per TP-4 server
        assert partial.window.max_started_per_sync == 768
        assert partial.window.max_inflight_prompts == min(768, 16 * per_role // 4)
    assert load_scenario("verl_7b_64").train.mini_batches == 16


def test_each_scenario_runs_the_in_flight_bound_of_the_system_it_reproduces():
    verl = policy_config("verl_7b_64", [], "partial")
    # verl's loss: clipped against the rollout engine's log-probs, no old or proximal pass
    assert verl.sim.train.rollout_logprobs and not verl.algorithm.decoupled
    areal = policy_config("areal_1p5b_128", [], "async")
    assert (areal.window.max_staleness, areal.window.max_inflight_prompts) == (4, 400)
    assert areal.window.max_started_per_sync == 0
    dora = policy_config("dora_64", [], "async")  # Eddy's own: the registry's K = 3
    assert (dora.window.max_staleness, dora.window.max_inflight_prompts) == (3, 0)
    assert not dora.sim.train.rollout_logprobs


def test_scales_parse_and_refuse_what_is_not_a_positive_factor_once():
    assert fidelity.parse_scales("0.5,1,2") == [0.5, 1.0, 2.0]
    for bad in ("0.5,x", "0,1", "-1", "1,1", ""):
        with pytest.raises(SystemExit, match="--scale"):
            fidelity.parse_scales(bad)


def test_a_row_scales_from_its_own_cluster_size():
    row = next(r for r in fidelity.ROWS if r.id == "verl_7b_32/fully_async")  # 16 : 16
    assert fidelity.scale_overrides(row, 1) == []
    assert fidelity.scale_overrides(row, 2)[:2] == ["sim.rollout.devices=32",
                                                     "sim.train.devices=32"]


def test_the_scaling_report_puts_scales_side_by_side_with_ratios_to_1x():
    row = fidelity.Row("t", "async", "dora_64", "partial", 50.0, "s")
    by_scale = {scale: [fidelity.Result(row, step, 0.0, {"split": split, "train_s": train,
                                                         "fits": fits})]
                for scale, step, split, train, fits in [(0.5, 300.0, "24:8", 200.0, False),
                                                        (1.0, 200.0, "48:16", 100.0, True),
                                                        (2.0, 150.0, "96:32", 50.0, None)]}
    out = fidelity.scaling_report(by_scale)
    assert ("| t/async | partial | 24:8, 300.0 (200.0) ✗ | 48:16, 200.0 (100.0) | "
            "96:32, 150.0 (50.0) | 1.50 | 0.75 |") in out
    assert "✗: the memory plan says" in out
    assert "step 0.5x / 1x" in out and "step 2x / 1x" in out


def test_both_rows_of_areal_s_table_generate_at_the_blogs_length():
    """One source for one table: AReaL's blog gives max_new_tokens=8192 for its 1.5B runs
    (configs/sim/areal_1p5b_128.yaml); no row of its table overrides it."""
    rows = [row for row in fidelity.ROWS if row.scenario == "areal_1p5b_128"]
    assert len(rows) == 2
    for row in rows:
        config = policy_config(row.scenario, list(row.overrides), row.policy)
        assert config.sim.workload.max_response_tokens == 8192, row.id

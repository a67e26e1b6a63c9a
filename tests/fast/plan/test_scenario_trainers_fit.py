"""The simulator times only trainers and engines that fit their devices: every bundled
scenario, at its own split and (where both roles run on one kind of device) colocated, is
planned by `eddy plan --cluster`'s memory plan as fitting. A scenario whose source does not
state its trainer's checkpointing and micro-batches takes the settings of the rule
`plan/cluster.py fitting_trainer` owns (the least recompute that fits, then the largest budget
of a power of two of longest sequences; the comment in each file says so): checked here against
the rule, so that a change to the memory model cannot leave a scenario's settings stale."""

from __future__ import annotations

import warnings

import pytest
import yaml

from eddyrl.config.bundled_configs import bundled_root
from eddyrl.plan.cluster import fitting_trainer, scenario_fit_plans
from eddyrl.sim.config import load_scenario

SCENARIOS = sorted(p.stem for p in (bundled_root() / "sim").glob("*.yaml"))
LESS_RECOMPUTE = {"full": "selective", "selective": "none"}


def _fits(scenario: str, overrides: list[str]) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # steps against K: not what this test is about
        return scenario_fit_plans(scenario, overrides)


def test_every_scenario_is_listed():
    assert {"dora_64", "verl_7b_64", "areal_1p5b_128", "scale_1024"} <= set(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_scenario_fits_as_simulated(scenario):
    for fit in _fits(scenario, []):
        assert fit["planned"], fit.get("reason")
        assert fit["fits"], (scenario, fit["devices"], fit["fixes"])


RULE_FOLLOWING = ["asyncflow_910b", "dora_128", "dora_64", "libra_48", "mixed_vendor",
                  "reflow_8", "scale_1024"]


def test_the_rule_following_scenarios_are_the_ones_that_say_so():
    says = [name for name in SCENARIOS
            if "least recompute that fits" in (bundled_root() / "sim" / f"{name}.yaml")
            .read_text()]
    assert says == RULE_FOLLOWING


@pytest.mark.parametrize("scenario", RULE_FOLLOWING)
def test_a_rule_following_scenario_has_the_rules_settings(scenario):
    train = yaml.safe_load((bundled_root() / "sim" / f"{scenario}.yaml").read_text())["train"]
    defaults = load_scenario(scenario, ["train.activation_checkpointing=none",
                                        "train.max_tokens_per_micro_batch=0"])
    assert defaults.train.max_tokens_per_micro_batch == 0
    expected = fitting_trainer(scenario)
    assert expected == (train["activation_checkpointing"], train["max_tokens_per_micro_batch"])
    # one step less recompute fits at no budget: not even one longest sequence a micro-batch
    kind = expected[0]
    if kind != "none":
        longest = load_scenario(scenario).sim.workload.longest_sequence
        assert not all(f["fits"] for f in _fits(scenario, [
            f"train.activation_checkpointing={LESS_RECOMPUTE[kind]}",
            f"train.max_tokens_per_micro_batch={longest}"]))

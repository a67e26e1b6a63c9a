"""The simulator times only trainers and engines that fit their devices: every bundled
scenario, at its own split and (where both roles run on one kind of device) colocated, is
planned by `eddy plan --cluster`'s memory plan as fitting. A scenario whose source does not
state its trainer's checkpointing and micro-batches takes the least recompute that fits, then
the largest budget in whole longest sequences (the comment in each file); that rule is pinned
here too: one step less recompute does not fit at the same budget."""

from __future__ import annotations

import warnings

import pytest
import yaml

from eddyrl.config.bundled_configs import bundled_root
from eddyrl.plan.cluster import candidate_config, memory_fit
from eddyrl.plan.cluster_search import Candidate
from eddyrl.sim.config import load_scenario

SCENARIOS = sorted(p.stem for p in (bundled_root() / "sim").glob("*.yaml"))
LESS_RECOMPUTE = {"full": "selective", "selective": "none"}


def _modes(config) -> tuple[str, ...]:
    same = config.sim.rollout.accelerator == config.sim.train.accelerator
    return ("partial", "colocated") if same else ("partial",)


def _fits(scenario: str, overrides: list[str]) -> list[dict]:
    config = load_scenario(scenario, overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # steps against K: not what this test is about
        return [memory_fit(candidate_config(scenario, overrides, Candidate(
            mode, config.sim.rollout.devices, config.sim.train.devices), 3))
            for mode in _modes(config)]


def test_every_scenario_is_listed():
    assert {"dora_64", "verl_7b_64", "areal_1p5b_128", "scale_1024"} <= set(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_scenario_fits_as_simulated(scenario):
    for fit in _fits(scenario, []):
        assert fit["planned"], fit.get("reason")
        assert fit["fits"], (scenario, fit["devices"], fit["fixes"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_less_recompute_would_not_fit(scenario):
    """Where the file chose its checkpointing by the rule, the next lighter kind does not fit
    (so the simulated recompute is physics, not a choice)."""
    path = bundled_root() / "sim" / f"{scenario}.yaml"
    train = (yaml.safe_load(path.read_text()) or {}).get("train") or {}
    kind = train.get("activation_checkpointing")
    if "least recompute that fits" not in path.read_text() or kind not in LESS_RECOMPUTE:
        pytest.skip(f"{scenario}: its checkpointing is its source's, or none")
    fits = _fits(scenario, [f"train.activation_checkpointing={LESS_RECOMPUTE[kind]}"])
    assert not all(f["fits"] for f in fits)

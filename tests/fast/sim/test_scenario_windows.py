"""Every bundled scenario's own settings (what `eddy sim SCENARIO` runs) can form a training
batch: with whole-batch refill the controller dispatches a batch only when all of it fits in
flight (core/controller.py `_dispatchable_groups`), so fewer groups in flight than a batch's
fresh groups would never start one (areal_1p5b_128 did: 400 in flight, batches of 512)."""

from pathlib import Path

import pytest

from eddyrl.core.replay import ReplayBuffer
from eddyrl.sim.config import load_scenario

SCENARIOS = sorted(p.stem for p in (Path(__file__).resolve().parents[3] / "eddyrl" / "configs"
                                    / "sim").glob("*.yaml"))


@pytest.mark.filterwarnings("ignore:window.max_staleness")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_scenario_window_admits_a_whole_batch(scenario):
    config = load_scenario(scenario)
    window = config.window
    fresh = ReplayBuffer(config.replay).fresh_slots(config.loop.batch_prompts)
    assert window.refill == "stream" or not window.max_inflight_prompts or \
        window.max_inflight_prompts >= fresh, (scenario, window)

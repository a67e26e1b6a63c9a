"""eddyrl/sim/scale.py: a scenario on a multiple of its cluster, each role's devices a multiple
of its tp, the instances following, the workload and batch unchanged."""

import pytest

from eddyrl.errors import ConfigError
from eddyrl.sim.config import load_scenario
from eddyrl.sim.scale import scale_overrides

# short runs warn that K >= loop.steps bounds nothing more; beside the point here
pytestmark = pytest.mark.filterwarnings("ignore:window.max_staleness")


def _scaled(scenario, factor, overrides=()):
    base = load_scenario(scenario, list(overrides))
    return base, load_scenario(scenario, [*overrides, *scale_overrides(base, factor)])


@pytest.mark.parametrize("factor", [0.5, 2])
def test_every_device_count_is_multiplied_and_the_workload_kept(factor):
    base, scaled = _scaled("dora_64", factor)
    assert (scaled.sim.rollout.devices, scaled.sim.train.devices) == \
        (base.sim.rollout.devices * factor, base.sim.train.devices * factor)
    assert scaled.rollout.num_workers == scaled.sim.rollout.devices // scaled.sim.rollout.tp
    assert (scaled.sim.rollout.tp, scaled.sim.train.tp) == (base.sim.rollout.tp,
                                                            base.sim.train.tp)
    assert (scaled.loop.batch_prompts, scaled.rollout.n_samples, scaled.sim.workload) == \
        (base.loop.batch_prompts, base.rollout.n_samples, base.sim.workload)


def test_a_row_size_override_is_what_gets_scaled():
    _, scaled = _scaled("verl_7b_64", 2, ["sim.rollout.devices=16", "sim.train.devices=16"])
    assert (scaled.sim.rollout.devices, scaled.sim.train.devices) == (32, 32)


def test_counts_round_to_whole_groups_of_tp_and_the_shard_group_still_divides():
    # verl_7b_64 with FSDP shard groups of 2: train 32 devices in tp 4; rollout tp 4
    _, scaled = _scaled("verl_7b_64", 0.3, ["sim.train.fsdp_size=2"])  # 9.6 -> 2 groups of 4
    assert (scaled.sim.rollout.devices, scaled.sim.train.devices) == (8, 8)
    assert scaled.sim.train.fsdp_size == 2
    base = load_scenario("verl_7b_64", ["sim.train.fsdp_size=16"])
    out = scale_overrides(base, 0.25)  # 8 training devices: a shard group of 16 cannot be
    assert "sim.train.fsdp_size=8" in out


def test_less_than_one_group_is_refused_naming_the_role():
    base = load_scenario("dora_64")  # training: 16 devices in tp 8
    with pytest.raises(ConfigError,
                       match=r"sim\.train\.devices = 16 x 0\.25 .* sim\.train\.tp = 8"):
        scale_overrides(base, 0.25)
    with pytest.raises(ConfigError, match="must be > 0"):
        scale_overrides(base, 0)

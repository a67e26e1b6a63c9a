"""The elastic pool's config-facing parts: pinned schedules and the cross-section checks."""

import pytest

from eddyrl.config import load_config
from eddyrl.core.elastic_driver import build_pool, parse_schedule
from eddyrl.errors import ConfigError
from eddyrl.scheduler.elastic import ElasticConfig, State


def test_schedule_entries_parse_and_bad_ones_are_named():
    assert parse_schedule(["3 join 1", "6 leave 1", "6 join 0"], 2) == \
        {3: [("join", 1)], 6: [("leave", 1), ("join", 0)]}
    with pytest.raises(ConfigError, match="'3 joins 1'"):
        parse_schedule(["3 joins 1"], 2)
    with pytest.raises(ConfigError, match="rollout worker 4 does not exist"):
        parse_schedule(["1 join 4"], 2)


def test_pool_ids_put_trainer_ranks_after_rollout_workers_as_the_fixed_core():
    pool = build_pool(3, 2, ElasticConfig(enabled=True))
    assert pool.rollout_workers() == [0, 1, 2] and pool.core == {3, 4}
    assert pool.state(4) is State.ACTIVE


@pytest.mark.parametrize("overrides,message", [
    (["adaptive.enabled=true"], "adaptive.enabled = True needs elastic.enabled"),
    (["elastic.enabled=true"], "no rollout worker could ever be lent"),
    (["elastic.enabled=true", "rollout.num_workers=2", "train.mini_batches=2"],
     "train.mini_batches = 1"),
    (["elastic.enabled=true", "rollout.num_workers=2", "algorithm.kl_coef=0.1"],
     "kl_coef = 0"),
    (["elastic.enabled=true", "rollout.num_workers=2", 'elastic.schedule=["x"]'],
     "elastic.schedule entry 'x'"),
])
def test_contradictory_elastic_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)

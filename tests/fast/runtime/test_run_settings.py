"""What the driver resolves once (eddyrl/resolved.py) and what each worker is told of it
(runtime/settings.py): the loaded config is never changed, and the workers' sections travel
to Ray actors as they are."""

import dataclasses
import pickle

import pytest

from eddyrl.config import load_config, to_yaml
from eddyrl.resolved import explicit_role_platforms, runtime_settings, with_role_platforms


def test_resolved_platforms_go_into_a_copy_not_into_the_loaded_config():
    config = load_config(overrides=["platform=auto", "train.platform=cpu"])
    before = to_yaml(config)
    recorded = with_role_platforms(config)
    assert to_yaml(config) == before  # the input as validated
    assert (recorded.rollout.platform, recorded.train.platform, recorded.platform) == \
        ("cpu", "cpu", "cpu")  # what config.yaml saves, and eval or a resume read back
    assert explicit_role_platforms(config) == {"rollout": False, "train": True}


def test_each_worker_gets_its_own_sections_frozen_and_picklable():
    config = load_config(overrides=["platform=cpu", "rollout.temperature=0.7",
                                    "rollout.num_workers=2", "elastic.enabled=true",
                                    "train.num_workers=2"])
    settings = runtime_settings(config)
    assert (settings.rollout_workers, settings.trainer_ranks) == (2, 2)
    assert settings.platforms.by_role() == {"rollout": "cpu", "train": "cpu"}
    assert settings.rollout.lent_to_training and settings.rollout.sampling_temperature == 0.7
    assert settings.trainer.rollout_engine == config.rollout.engine
    assert pickle.loads(pickle.dumps(settings)) == settings  # Ray's `.remote(...)` arguments
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.trainer.seed = 1  # type: ignore[misc]


def test_ray_placement_reads_the_worker_counts_from_the_runtime_settings():
    from eddyrl.errors import ConfigError
    from eddyrl.runtime.ray.placement import colocation_group

    settings = dataclasses.replace(runtime_settings(load_config(overrides=["platform=cpu"])),
                                   rollout_workers=2, trainer_ranks=1)
    with pytest.raises(ConfigError, match="rollout.num_workers = 2 and train.num_workers = 1"):
        colocation_group(settings, "cpu", 1.0)  # refused before anything is asked of Ray

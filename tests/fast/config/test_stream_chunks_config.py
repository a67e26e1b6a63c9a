"""`train.stream_chunks` (a step trained in parts as its groups are collected): settings that
could not run are refused before the run, by name."""

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError


def test_parts_of_whole_optimizer_steps_are_accepted():
    config = load_config(overrides=["loop.batch_prompts=8", "train.mini_batches=4",
                                    "train.stream_chunks=2"])
    assert config.train.stream_chunks == 2 and config.train.mini_batches_per_call == 2
    assert load_config().train.stream_chunks == 1  # the default: the whole batch at once


def test_parts_that_would_split_an_optimizer_step_are_refused():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["train.mini_batches=4", "train.stream_chunks=3"])
    message = str(error.value)
    assert "train.stream_chunks = 3 does not divide train.mini_batches = 4" in message


def test_a_part_without_a_fresh_group_is_refused():
    # sigma 0.5 of 4: 2 fresh groups a step for 4 parts
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["loop.batch_prompts=4", "train.mini_batches=4",
                               "train.stream_chunks=4", "replay.max_fraction=0.5",
                               "replay.loss_weight=0.5", "replay.max_lag=2"])
    assert "train.stream_chunks = 4 with 2 fresh group(s) a step" in str(error.value)


def test_colocated_roles_cannot_train_while_the_rest_generates():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["cluster.placement=colocated", "cluster.runtime=ray",
                               "loop.batch_prompts=8", "train.mini_batches=2",
                               "train.stream_chunks=2"])
    assert "cluster.placement = colocated with train.stream_chunks = 2" in str(error.value)

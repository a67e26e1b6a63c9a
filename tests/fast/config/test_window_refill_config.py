"""Window settings that could never form a training batch are refused before the run, by name."""

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError


def test_whole_batch_refill_with_fewer_groups_in_flight_than_a_batch_is_refused():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["loop.batch_prompts=8", "window.max_staleness=1",
                               "window.max_inflight_prompts=6", "window.refill=batch"])
    message = str(error.value)
    assert "window.max_inflight_prompts = 6 < the 8 fresh groups" in message
    assert "window.refill = stream" in message


def test_replayed_slots_leave_fewer_fresh_groups_to_fit_in_flight():
    # sigma 0.25 of 8: 2 replayed, 6 fresh, so 6 in flight can form each batch
    config = load_config(overrides=["loop.batch_prompts=8", "window.max_staleness=1",
                                    "window.max_inflight_prompts=6", "replay.max_fraction=0.25",
                                    "replay.loss_weight=0.5", "replay.max_lag=2"])
    assert config.window.max_inflight_prompts == 6


def test_streaming_refill_may_keep_fewer_groups_in_flight_than_a_batch():
    config = load_config(overrides=["loop.batch_prompts=8", "window.max_staleness=1",
                                    "window.max_inflight_prompts=6", "window.refill=stream"])
    assert config.window.refill == "stream"


def test_elastic_with_several_optimizer_steps_says_why_it_cannot_work():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["rollout.num_workers=2", "elastic.enabled=true",
                               "train.mini_batches=2"])
    assert "steps 2..2 run on weights it receives only at the next weight sync" in \
        str(error.value)

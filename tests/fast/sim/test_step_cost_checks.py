"""The engine step's cost (scheduler/cost_model.py `engine_step_seconds`), asked for every
decode interval of every simulated engine, checks its arguments with one comparison each and
names the bad one only when a comparison fails: the same errors as a check per argument."""

import math

import pytest

from eddyrl.errors import ConfigError
from eddyrl.scheduler.cost_model import CostModel

COST = CostModel("H100", "Qwen3-4B", tp=2)
ARGUMENTS = ("batch", "mean_context", "prefill_tokens", "prefill_context", "prefill_sequences")


@pytest.mark.parametrize("name", ARGUMENTS)
@pytest.mark.parametrize("bad", [-1, math.nan, math.inf])
def test_a_bad_argument_is_named(name, bad):
    values = dict(batch=4, mean_context=1000.0, prefill_tokens=256, prefill_context=10.0,
                  prefill_sequences=2)
    values[name] = bad
    with pytest.raises(ConfigError, match=f"'{name}'"):
        COST.engine_step_seconds(**values)


def test_good_arguments_cost_what_they_did():
    # zero work is free; the decode step is the engine step without prefill
    assert COST.engine_step_seconds(0, 0.0) == 0.0
    assert COST.decode_step_seconds(8, 2000.0) == COST.engine_step_seconds(8, 2000.0) > 0
    assert COST.engine_step_seconds(8, 2000.0, 512, 100.0, 2) > \
        COST.engine_step_seconds(8, 2000.0)

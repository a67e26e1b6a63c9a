"""Values that passed validation and then misbehaved (issue 32): a sampling temperature of 0
or near it, and a seed no random generator takes. Each is one ConfigError at load time now,
naming the key, the value and why."""

import numpy as np
import pytest
import torch

from eddyrl.config import load_config
from eddyrl.config.schema import MAX_SEED
from eddyrl.engines.inference.sampling import sample
from eddyrl.errors import ConfigError
from eddyrl.validation import MIN_TEMPERATURE


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(None, list(overrides), check_files=False)
    return str(error.value)


def test_rollout_temperature_0_is_refused():
    """Before: `rollout.temperature=0` sampled greedily, every response of a group was the
    same, every advantage 0, and 100 steps trained nothing without a word."""
    message = refused("rollout.temperature=0")
    assert message.startswith("config key 'rollout.temperature' = 0.0: greedy sampling trains "
                              "nothing")
    assert "every advantage is 0" in message and "loop.eval_temperature = 0" in message


def test_rollout_temperature_1e_45_is_refused():
    """Before: `rollout.temperature=1e-45` divided every logit into inf and sampling raised
    (a traceback)."""
    message = refused("rollout.temperature=1e-45")
    assert message.startswith(f"config key 'rollout.temperature' = 1e-45 is below "
                              f"{MIN_TEMPERATURE}, the lowest sampling temperature")
    assert message.endswith(f"use at least {MIN_TEMPERATURE}")


def test_the_lowest_temperature_samples_and_below_it_overflows():
    """What the bound stands on: at MIN_TEMPERATURE large logits still give finite log-probs;
    at 1e-45 sampling fails."""
    logits = torch.tensor([[30.0, -20.0, 5.0, 29.0]])
    tokens, logprobs = sample(logits, temperature=MIN_TEMPERATURE,
                              generator=torch.Generator().manual_seed(0))
    assert tokens.tolist() == [0] and torch.isfinite(logprobs).all()
    with pytest.raises(RuntimeError):
        sample(logits, temperature=1e-45, generator=torch.Generator().manual_seed(0))


def test_greedy_evaluation_stays_allowed():
    """Held-out evaluation has its own temperature: 0 is greedy there; the overflow bound
    holds for it too."""
    assert load_config(None, ["loop.eval_temperature=0"], check_files=False) \
        .loop.eval_temperature == 0
    message = refused("loop.eval_temperature=1e-45")
    assert message.startswith("config key 'loop.eval_temperature' = 1e-45 is below")
    assert message.endswith(f"use 0 for greedy or at least {MIN_TEMPERATURE}")


def test_seed_1e23_is_refused():
    """Before: `seed=100000000000000000000000` passed validation and every generator it
    reached raised (torch: "Overflow when unpacking long long")."""
    message = refused("seed=100000000000000000000000")
    assert message.startswith(f"config key 'seed' = 100000000000000000000000 is out of range; "
                              f"allowed: [0, {MAX_SEED}]")
    assert f"'seed' = {MAX_SEED + 1} is out of range" in refused(f"seed={MAX_SEED + 1}")
    assert load_config(None, [f"seed={MAX_SEED}"], check_files=False).seed == MAX_SEED


def test_every_seed_derived_from_the_largest_is_taken():
    """The largest seed and what Eddy derives from it (a rollout worker's engine: seed * 1000
    + index) seed numpy's legacy generator (as vLLM does), torch and `random`."""
    for seed in (MAX_SEED, MAX_SEED * 1000 + 999):
        np.random.RandomState(seed)  # what np.random.seed seeds
        torch.Generator().manual_seed(seed)
    with pytest.raises(ValueError):
        np.random.RandomState(2 ** 32)

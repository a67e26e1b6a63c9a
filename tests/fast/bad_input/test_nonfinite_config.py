"""NaN and inf in the config: NaN passes every range check (`value < lo` is false for NaN), and an
infinite learning rate turns the weights to NaN. Every float field of the config tree, found
from the schema's types so that a new key is covered without a test of its own, refuses nan, inf
and -inf by name; the one key where inf means something (`loop.max_seconds`: no limit) says so
on its field and takes inf."""

import copy
import dataclasses
import math
import typing

import pytest

from eddyrl.config import EddyConfig, load_config
from eddyrl.errors import ConfigError
from eddyrl.sim.config import SimRunConfig
from eddyrl.validation import check_range

BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
ALLOWED_INF = {"loop.max_seconds"}  # declared with `inf_allowed`; nothing else takes inf


def float_fields(schema: type, prefix: str = ""):
    """(dotted key, field) of every float-typed field (float, or float | None) under `schema`,
    by its type annotations."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from float_fields(kind, f"{prefix}{f.name}.")
        elif kind is float or float in typing.get_args(kind):
            yield f"{prefix}{f.name}", f


def with_value(config, key: str, value: float):
    config = copy.deepcopy(config)
    *sections, leaf = key.split(".")
    node = config
    for section in sections:
        node = getattr(node, section)
    setattr(node, leaf, value)
    return config


ROOT_FIELDS = dict(float_fields(EddyConfig))
SIM_FIELDS = {k: f for k, f in float_fields(SimRunConfig) if k.startswith("sim.")}


def test_the_sweep_sees_the_float_keys():
    """The sweep below covers what it should: the keys of the issue, and every section."""
    from eddyrl.validation import ALLOW_INF

    assert {"train.lr", "rollout.temperature", "data.reward_timeout_s", "cluster.timeout_s",
            "env.cutoff_reward", "algorithm.tis_cap", "adaptive.borrow_ratio"} <= set(ROOT_FIELDS)
    assert len(ROOT_FIELDS) >= 20 and len(SIM_FIELDS) >= 10
    declared = {k for k, f in {**ROOT_FIELDS, **SIM_FIELDS}.items() if ALLOW_INF in f.metadata}
    assert declared == ALLOWED_INF


@pytest.fixture(scope="module")
def defaults():
    return load_config()


@pytest.fixture(scope="module")
def sim_defaults():
    return SimRunConfig()


@pytest.mark.parametrize("word", BAD)
def test_every_float_key_refuses_nonfinite_values_by_name(defaults, sim_defaults, word):
    value, accepted = BAD[word], []
    for fields, base in ((ROOT_FIELDS, defaults), (SIM_FIELDS, sim_defaults)):
        for key in fields:
            if word == "inf" and key in ALLOWED_INF:
                continue
            config = with_value(base, key, value)
            try:
                config.validate()
            except ConfigError as error:
                assert f"config key {key!r} = {word}" in str(error), (key, str(error))
            else:
                accepted.append(key)
    assert accepted == []


@pytest.mark.parametrize("override, message", [
    pytest.param("train.lr=nan", "config key 'train.lr' = nan is not a number; give a finite "
                 "value", id="nan-lr"),
    pytest.param("rollout.temperature=nan", "config key 'rollout.temperature' = nan is not a "
                 "number; give a finite value", id="nan-temperature"),
    pytest.param("data.reward_timeout_s=nan", "config key 'data.reward_timeout_s' = nan is not "
                 "a number; give a finite value", id="nan-reward-timeout"),
    pytest.param("train.lr=inf", "config key 'train.lr' = inf is not a finite number; give a "
                 "finite value", id="inf-lr"),
    pytest.param("env.cutoff_reward=-.inf", "config key 'env.cutoff_reward' = -inf is not a "
                 "finite number; give a finite value", id="unchecked-key-minus-inf"),
    pytest.param("loop.max_seconds=nan", "config key 'loop.max_seconds' = nan is not a number; "
                 "give a finite value (or inf: no limit, as 0)", id="nan-where-inf-allowed"),
    pytest.param("loop.max_seconds=-inf", "config key 'loop.max_seconds' = -inf is out of "
                 "range; allowed: [0, inf]", id="minus-inf-where-inf-allowed"),
])
def test_nonfinite_overrides_are_refused_by_name(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[override])
    assert str(error.value) == message


def test_inf_where_it_means_no_limit():
    assert load_config(overrides=["loop.max_seconds=inf"]).loop.max_seconds == math.inf


def test_range_checks_refuse_nan_and_inf_themselves():
    """For callers outside the config tree (the version window, the simulator's parts)."""
    with pytest.raises(ConfigError, match="'k' = nan is not a number"):
        check_range("k", math.nan, 0, 1)
    with pytest.raises(ConfigError, match="'k' = inf is not a finite number"):
        check_range("k", math.inf, 0)
    check_range("k", math.inf, 0, allow_inf=True)

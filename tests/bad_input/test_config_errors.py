"""Bad config: wrong types, out-of-range values, unknown keys and sections, contradictions,
malformed or missing files, override syntax. Each names the key (or file and line), the bad
value and what is allowed."""

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError

CLI = "in the command-line overrides"


def config_error(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(path, overrides)
    return str(error.value)


@pytest.mark.parametrize("overrides, message", [
    pytest.param(["rollout.num_workers=abc"],
                 f"config key 'rollout.num_workers' {CLI}: Value 'abc' of type 'str' could not "
                 "be converted to Integer", id="string-for-int"),
    pytest.param(["elastic.enabled=maybe"],
                 f"config key 'elastic.enabled' {CLI}: Value 'maybe' is not a valid bool",
                 id="string-for-bool"),
    pytest.param(["seed=null"],
                 f"config key 'seed' {CLI}: Incompatible value 'None' for field of type 'int'",
                 id="null-for-int"),
    pytest.param(["rollout=3"],
                 f"config key 'rollout' {CLI} is a section; expected a mapping of its keys, got 3",
                 id="scalar-for-section"),
    pytest.param(["rollout.top_p=1.5"],
                 "config key 'rollout.top_p' = 1.5 is out of range; allowed: (0, 1]",
                 id="above-range"),
    pytest.param(["train.lr=0"],
                 "config key 'train.lr' = 0.0 is out of range; allowed: (0, inf)",
                 id="open-bound"),
    pytest.param(["rollout.engin=hf"],
                 f"unknown config key 'rollout.engin' {CLI}; did you mean 'rollout.engine'? "
                 "(valid keys here: engine, platform,", id="unknown-key"),
    pytest.param(["rolout.engine=hf"],
                 f"unknown config key 'rolout' {CLI}; did you mean 'rollout'?",
                 id="unknown-section"),
    pytest.param(["num_workers=2"],
                 f"unknown config key 'num_workers' {CLI}; did you mean 'train.num_workers'?",
                 id="leaf-in-wrong-section"),
])
def test_bad_values_and_keys_are_named(overrides, message):
    assert message in config_error(overrides=overrides)


@pytest.mark.parametrize("overrides, message", [
    # sigma > 0 with delta < 0: delta is checked first, by its own range
    pytest.param(["replay.max_fraction=0.25", "replay.max_lag=-1"],
                 "config key 'replay.max_lag' = -1 is out of range; allowed: [0, inf)",
                 id="replay-with-negative-lag"),
    pytest.param(["replay.max_fraction=0.25", "replay.max_lag=0"],
                 "contradictory settings: replay.max_fraction = 0.25 with replay.max_lag = 0: a "
                 "replayed group is always at least 1 version old", id="replay-with-zero-lag"),
    pytest.param(["replay.max_fraction=0.5", "replay.loss_weight=0"],
                 "contradictory settings: replay.max_fraction = 0.5 replays groups but "
                 "replay.loss_weight = 0 gives them no gradient", id="replay-with-no-weight"),
    pytest.param(["cluster.placement=colocated", "window.max_staleness=1"],
                 "contradictory settings: cluster.placement = colocated with "
                 "window.max_staleness = 1", id="colocated-async"),
    pytest.param(["data.train_path=/data/train.jsonl"],
                 "contradictory settings: data.train_path and data.eval_path must be given "
                 "together", id="train-without-eval"),
])
def test_contradictory_settings_are_named(overrides, message):
    assert message in config_error(overrides=overrides)


@pytest.mark.parametrize("override", ["platform", "rollout.engine", "rollout..engine=hf", "=cpu"])
def test_override_without_key_value_form(override):
    assert config_error(overrides=[override]) == (
        f"override {override!r} is not of the form key=value (e.g. platform=cpu or "
        "rollout.engine=hf)")


@pytest.mark.parametrize("text, message", [
    pytest.param("platform: cpu\nrollout:\n  engine: [hf\ntrain:\n  lr: 1\n",
                 "is not valid YAML at line 4, column 6: expected ',' or ']', but got ':'",
                 id="unclosed-list"),
    pytest.param("rollout:\n\tengine: hf\n",
                 "is not valid YAML at line 2, column 1: found character '\\t' that cannot "
                 "start any token", id="tab-indent"),
    pytest.param("rollout:\n  engine: hf\n  engine: vllm\n",
                 "is not valid YAML at line 3, column 3: key 'engine' is given twice (lines 2 "
                 "and 3)", id="duplicate-key"),
    pytest.param("- platform: cpu\n", "must hold a mapping of keys, not list", id="not-a-mapping"),
])
def test_malformed_yaml_names_file_and_line(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert config_error(path) == f"config file '{path}' {message}"


@pytest.mark.parametrize("text, message", [
    pytest.param("seed: three\n",
                 "config key 'seed' in '{path}': Value 'three' of type 'str' could not be "
                 "converted to Integer", id="wrong-type-in-file"),
    pytest.param("trian:\n  lr: 0.1\n",
                 "unknown config key 'trian' in '{path}'; did you mean 'train'?",
                 id="unknown-section-in-file"),
])
def test_bad_keys_in_a_file_name_the_file(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert message.format(path=path) in config_error(path)


def test_config_file_that_does_not_exist(tmp_path):
    path = tmp_path / "nope.yaml"
    assert config_error(path) == f"config file '{path}' does not exist"

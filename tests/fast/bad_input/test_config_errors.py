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


def test_config_file_that_is_a_directory(tmp_path):
    assert config_error(tmp_path) == (f"config file '{tmp_path}' is a directory; give the path "
                                      "of a YAML file (or a bundled config's name)")


@pytest.mark.parametrize("data, message", [
    pytest.param(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
                 "is not a text YAML file (binary: a NUL byte at byte 8); give a UTF-8 YAML file",
                 id="binary"),
    pytest.param(b"rollout:\n  engine: hf # caf\xe9\n",
                 "is not a text YAML file (binary: byte 0xe9 at byte 27, line 2, is not UTF-8); "
                 "give a UTF-8 YAML file", id="not-utf8"),
    pytest.param("platform: cpu\n".encode("utf-16"),
                 "is not a text YAML file: it is UTF-16 (it starts with a UTF-16 byte-order "
                 "mark); save it as UTF-8", id="utf-16"),
])
def test_config_file_that_is_not_text_yaml(tmp_path, data, message):
    path = tmp_path / "run.yaml"
    path.write_bytes(data)
    assert config_error(path) == f"config file '{path}' {message}"


def test_config_file_with_a_utf8_byte_order_mark_loads(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xef\xbb\xbfseed: 3\n")
    assert load_config(path).seed == 3


def test_one_sample_per_prompt_trains_nothing():
    assert config_error(overrides=["rollout.n_samples=1"]) == (
        "config key 'rollout.n_samples' = 1 trains nothing: a response's advantage is its "
        "reward minus the mean of its prompt's group (GRPO, Dr. GRPO), so in a group of one it "
        "is always 0; sample at least 2 responses per prompt")


def test_staleness_the_run_cannot_use_is_warned_with_the_reason():
    with pytest.warns(UserWarning) as caught:
        load_config(overrides=["window.max_staleness=8", "loop.steps=4", "loop.batch_prompts=16"])
    assert [str(w.message) for w in caught] == [
        "window.max_staleness = 8 with loop.steps = 4: no trained group can be more than 3 "
        "version(s) old in 4 step(s), and up to 8 x loop.batch_prompts = 128 groups generated "
        "ahead are never trained (the run trains 64); set window.max_staleness <= 3, or bound "
        "the groups in flight with window.max_inflight_prompts"]


@pytest.mark.parametrize("overrides", [
    pytest.param(["window.max_staleness=3", "loop.steps=4"], id="usable"),
    pytest.param(["window.max_staleness=8", "loop.steps=4", "window.max_inflight_prompts=16"],
                 id="bounded-in-flight"),
    pytest.param(["window.max_staleness=0", "loop.steps=0"], id="sync"),
])
def test_staleness_the_run_can_use_is_not_warned(overrides, recwarn):
    load_config(overrides=overrides)
    assert not [w for w in recwarn if "max_staleness" in str(w.message)]

"""Bundled configs (eddyrl/configs/, package data) by name: every command that takes a config
file takes a bundled name too; a file that exists wins; an unknown name lists what exists."""

from pathlib import Path

import pytest

from eddyrl.cli import main
from eddyrl.config import bundled, bundled_names, bundled_root, load_config, resolve_config
from eddyrl.errors import ConfigError


def test_the_names_are_the_files_under_the_package():
    names = bundled_names()
    assert {"tiny_cpu", "tool_add_tiny", "modes/replay", "modes/multiversion", "sim/dora_64",
            "recipes/qwen3_4b_dapo_math_gpu"} <= set(names)
    assert "dora_64" in bundled_names("sim") and "replay" in bundled_names("modes")
    assert bundled_root().name == "configs" and bundled_root().parent.name == "eddyrl"
    for name in names:
        assert bundled(name) == bundled_root() / f"{name}.yaml"


def test_a_name_with_or_without_yaml_and_a_default_folder():
    assert bundled("sim/dora_64") == bundled("sim/dora_64.yaml") == bundled("dora_64", "sim")
    assert bundled("tool_add_tiny").name == "tool_add_tiny.yaml"


def test_a_file_that_exists_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tool_add_tiny").write_text("seed: 5\n")
    assert resolve_config("tool_add_tiny") == Path("tool_add_tiny")
    assert load_config("tool_add_tiny").seed == 5
    assert resolve_config(None) is None


def test_load_config_takes_a_name():
    assert load_config("modes/replay") == load_config(bundled_root() / "modes" / "replay.yaml")
    assert load_config("tiny_cpu") == load_config(overrides=["platform=cpu"])


def test_an_unknown_name_lists_the_bundled_ones():
    with pytest.raises(ConfigError) as error:
        load_config("modes/replai")
    message = str(error.value)
    assert "config file 'modes/replai' does not exist" in message
    assert "did you mean 'modes/replay'?" in message and "sim/dora_64" in message
    with pytest.raises(ConfigError, match="did you mean 'dora_64'.*scenarios: \\["):
        resolve_config("configs/sim/dora_64.yaml", "sim")  # the folder's old place


def test_a_missing_absolute_path_is_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="^config file '.*nope.yaml' does not exist$"):
        load_config(tmp_path / "nope.yaml")


def test_the_commands_take_bundled_names(capsys):
    assert main(["config", "show", "modes/replay", "seed=3"]) == 0
    out = capsys.readouterr().out
    assert "seed: 3" in out
    assert f"max_fraction: {load_config('modes/replay').replay.max_fraction}" in out
    assert main(["config", "show", "tool_add_tiny"]) == 0
    assert "calculator" in capsys.readouterr().out
    assert main(["config", "show", "nope"]) == 2
    assert "bundled configs: " in capsys.readouterr().err

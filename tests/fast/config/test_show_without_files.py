"""Issue 34, item 4: a recipe can be inspected before its model and data are downloaded
(`eddy config show` and `eddy plan` validate keys and values only); `eddy train` still checks
that the files exist."""

import pytest

from eddyrl.cli import main
from eddyrl.config import load_config
from eddyrl.errors import ConfigError

RECIPE = "recipes/qwen3_4b_dapo_math_gpu"


def test_config_show_prints_a_recipe_whose_model_is_not_here(capsys):
    assert main(["config", "show", RECIPE]) == 0
    shown = capsys.readouterr().out
    assert "Qwen3-4B" in shown and "train_path" in shown


def test_a_bad_value_in_a_recipe_is_still_refused_by_config_show(capsys):
    assert main(["config", "show", RECIPE, "rollout.temperature=-1"]) == 2
    assert "config key 'rollout.temperature' = -1.0 is out of range" in capsys.readouterr().err


def test_training_the_recipe_checks_its_files():
    with pytest.raises(ConfigError, match="model.path"):
        load_config(RECIPE)  # what eddy train loads


def test_config_show_diff_prints_only_what_a_mode_changes(capsys):
    """Issue 34, item 7: `eddy config show modes/replay` printed all its lines, with no way to
    see only what the mode changes."""
    assert main(["config", "show", "modes/replay", "--diff"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "replay.max_fraction: 0.25" in lines and "window.max_staleness: 1" in lines
    assert len(lines) < 10 and not any(line.startswith("seed:") for line in lines)


def test_eddy_version(capsys):
    import pytest

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("eddy ")

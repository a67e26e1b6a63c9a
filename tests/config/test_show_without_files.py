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

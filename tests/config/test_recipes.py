"""eddyrl/configs/recipes/: every recipe loads and validates with a stand-in model directory
(loading checks that model.path is one), keeps DAPO's settings, and reads the DAPO-Math sample
data."""

from pathlib import Path

import pytest

from eddyrl.config import bundled_root, load_config
from eddyrl.errors import ConfigError
from eddyrl.tasks.prompts import load_splits

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((bundled_root() / "recipes").glob("*.yaml"))
SAMPLE = ROOT / "tests" / "data" / "dapo_math_sample.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("stand_in_model")
    # all that loading a config checks: config.json and weights in safetensors
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_recipes_are_there():
    assert {p.name for p in RECIPES} >= {"qwen3_4b_dapo_math_gpu.yaml",
                                         "qwen3_4b_dapo_math_npu.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_with_dapo_settings(recipe, model_dir):
    config = load_config(recipe, [f"model.path={model_dir}"])
    assert config.platform == ("npu" if recipe.stem.endswith("_npu") else "cuda")
    assert config.rollout.engine == "vllm" and config.rollout.n_samples == 16
    assert 8192 <= config.rollout.max_new_tokens <= 20480
    assert config.algorithm.clip_high == 0.28 and config.algorithm.dynamic_sampling
    assert config.loop.batch_prompts <= 512
    assert config.data.format == "dapo_math"
    assert config.data.reward_fn == "eddyrl.tasks.math_reward:reward"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_names_the_missing_model(recipe):
    with pytest.raises(ConfigError, match="model.path"):
        load_config(recipe)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_reads_dapo_math_rows_and_loads_its_reward(recipe, model_dir, tmp_path):
    pytest.importorskip("math_verify")
    from eddyrl.core.rewarding import load_reward_fn

    config = load_config(recipe, [f"model.path={model_dir}", f"data.train_path={SAMPLE}",
                                  f"data.eval_path={SAMPLE}"])
    train, evals, _, _ = load_splits(config.data, tmp_path, config.seed)
    assert len(train) == len(evals) == 4 and train[0]["answer"] == "26"
    assert isinstance(train[0]["prompt"], list) and train[0]["prompt"][0]["role"] == "user"
    reward = load_reward_fn(config.data.reward_fn)
    assert reward("...\nAnswer: 26", train[0]["answer"]) == 1.0

"""eddyrl/configs/recipes/: every recipe loads and validates with a stand-in model directory
(loading checks that model.path is one), keeps DAPO's settings, reads the DAPO-Math sample
data, and `eddy plan` predicts that it fits its devices with margin, offline (the shipped
shape its `model.shape` names, no weights)."""

import json

from pathlib import Path

import pytest

from eddyrl.config import bundled_root, load_config
from eddyrl.errors import ConfigError
from eddyrl.tasks.prompts import load_splits

ROOT = Path(__file__).resolve().parents[3]
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
                                         "qwen3_4b_dapo_math_npu.yaml",
                                         "qwen3_8b_dapo_math_gpu.yaml",
                                         "qwen3_30b_a3b_dapo_math_gpu.yaml"}


# The devices each recipe is written for, and the least free share of each at the plan's peak.
RECIPE_DEVICES = {"qwen3_4b_dapo_math_gpu": "H100", "qwen3_4b_dapo_math_npu": "910B",
                  "qwen3_8b_dapo_math_gpu": "H100", "qwen3_30b_a3b_dapo_math_gpu": "H100"}
MARGIN = 0.05


# Recipes `eddy plan` says do not fit yet, and why (their README says what is missing).
NOT_YET: dict[str, str] = {}


@pytest.mark.parametrize("recipe", [
    pytest.param(p, marks=pytest.mark.xfail(reason=NOT_YET[p.stem], strict=True))
    if p.stem in NOT_YET else p for p in RECIPES], ids=lambda p: p.stem)
def test_recipe_fits_its_devices_by_eddy_plan(recipe, capsys):
    from eddyrl.cli import main

    status = main(["plan", str(recipe), "--device", RECIPE_DEVICES[recipe.stem], "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert status == 0 and plan["fits"], plan
    assert f"assets/shapes/{load_config(recipe, check_files=False).model.shape}/" in \
        plan["model"]
    for device in plan["devices"]:
        assert device["margin"] >= MARGIN * device["memory"]["bytes"], device


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


def test_qwen3_30b_a3b_fits_only_with_a_bf16_rollout_engine(capsys):
    """In float32 its weights alone (114 GiB) are over an 80 GB device: the plan names the
    rollout, and bf16, the recipe's setting, as the fix."""
    from eddyrl.cli import main

    recipe = bundled_root() / "recipes" / "qwen3_30b_a3b_dapo_math_gpu.yaml"
    assert main(["plan", str(recipe), "--device", "H100", "--json", "rollout.dtype=fp32"]) == 1
    plan = json.loads(capsys.readouterr().out)
    fits = {device["label"]: device["fits"] for device in plan["devices"]}
    assert fits == {"train": True, "rollout": False}
    assert [f["override"] for f in plan["fixes"]] == ["rollout.dtype=bf16"]
    assert plan["fixes"][0]["fits"]


def test_the_readme_shows_each_recipes_plan(capsys):
    """The summary table of recipes/README.md is what `eddy plan` says now (the full plans
    below it come from the same command: regenerate both together)."""
    from eddyrl.cli import main

    readme = (bundled_root() / "recipes" / "README.md").read_text()
    for recipe in RECIPES:
        main(["plan", str(recipe), "--device", RECIPE_DEVICES[recipe.stem], "--json"])
        plan = json.loads(capsys.readouterr().out)
        devices = {d["label"]: d for d in plan["devices"]}
        train, rollout = devices["train"], devices["rollout"]
        over = sorted(label for label, d in devices.items() if not d["fits"])
        row = (f"| `{recipe.stem}` | {train['count']} + {rollout['count']} x "
               f"{train['memory']['name']} ({train['memory']['bytes'] / 2**30:.1f} GiB) | "
               f"{train['peak'] / 2**30:.1f} GiB | {rollout['peak'] / 2**30:.1f} GiB | "
               f"{'yes' if plan['fits'] else 'no: ' + ', '.join(over)} |")
        assert row in readme, f"recipes/README.md lacks the plan's row:\n{row}"

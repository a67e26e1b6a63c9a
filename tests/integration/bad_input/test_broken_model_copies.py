"""Bad model input made from a copy of the tiny model: a checkpoint without config.json, a
directory without a tokenizer, a corrupt config.json, a tokenizer with more tokens than the
model has embeddings. Each is refused at start-up naming the path. (Bad model input made of
files alone, no model built: test_model_errors.py.)"""

import json
import shutil

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError


def prepare_error(model_dir, tmp_path) -> str:
    """The error `eddy train` stops with while preparing a run on `model_dir`."""
    from eddyrl.launch import prepare

    config = load_config(overrides=["data.train_size=4", "data.eval_size=2"])
    with pytest.raises(ConfigError) as error:
        prepare(config, str(model_dir), tmp_path / "data")
    return str(error.value)


def copy_model(tiny_model_dir, tmp_path, drop=()):
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target, ignore=shutil.ignore_patterns(*drop))
    return target


def test_checkpoint_without_config_json(tiny_model_dir, tmp_path):
    from eddyrl.launch import evaluate_checkpoint

    checkpoint = copy_model(tiny_model_dir, tmp_path, drop=["config.json"])
    with pytest.raises(ConfigError) as error:
        evaluate_checkpoint(load_config(), str(checkpoint), tmp_path / "data")
    assert str(error.value) == (f"checkpoint '{checkpoint}': {checkpoint} has no config.json, "
                                "so it is not a Hugging Face model directory (expected "
                                "config.json and the weights as *.safetensors)")


def test_model_directory_without_a_tokenizer(tiny_model_dir, tmp_path):
    # transformers would build an empty tokenizer from config.json alone
    model = copy_model(tiny_model_dir, tmp_path, drop=["tokenizer*", "special_tokens_map.json",
                                                        "chat_template*"])
    assert prepare_error(model, tmp_path) == (
        f"model directory '{model}' has no tokenizer (none of tokenizer.json, "
        "tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt); save the model's "
        "tokenizer next to it (tokenizer.save_pretrained)")


def test_corrupt_config_json(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path)
    (model / "config.json").write_text('{"vocab_size": 54,')
    assert prepare_error(model, tmp_path).startswith(
        f"model directory '{model}': the model's config or tokenizer does not load "
        "(JSONDecodeError: ")


def test_tokenizer_larger_than_the_embedding_names_both_sizes(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    model = copy_model(tiny_model_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    tokens = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert config["vocab_size"] == tokens  # the good pair loads (see below)
    config["vocab_size"] = tokens - 10
    (model / "config.json").write_text(json.dumps(config))
    assert prepare_error(model, tmp_path) == (
        f"model directory '{model}': the tokenizer has {tokens} tokens but the model's "
        f"embedding table has vocab_size = {tokens - 10}; token ids from {tokens - 10} up "
        "have no embedding, so this tokenizer does not belong to this model")
    config["vocab_size"] = tokens + 10  # a padded embedding table is normal
    (model / "config.json").write_text(json.dumps(config))
    from eddyrl.models.config import load_tokenizer

    assert len(load_tokenizer(str(model))) == tokens

"""eddyrl/plan/shapes.py, read from config.json alone: MoE layers follow decoder_sparse_step and
mlp_only_layers, load_shape takes a directory or the file, and errors name the file and the
key. (Parameter counts against transformers' own: test_model_shapes_against_transformers.py.)"""

import json

import pytest
from shape_cases import CASES, QWEN3

from eddyrl.errors import ConfigError
from eddyrl.plan.shapes import load_shape, shape_from_config


def test_moe_layers_follow_sparse_step_and_mlp_only_layers():
    shape = shape_from_config(CASES["qwen3-moe"])
    assert [shape.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert shape.active_parameters() < shape.parameters()


def test_load_shape_takes_a_directory_or_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    assert load_shape(tmp_path) == load_shape(tmp_path / "config.json")
    assert load_shape(tmp_path).tied_embeddings and load_shape(tmp_path).kv_heads == 8


def test_errors_name_the_file_and_the_key(tmp_path):
    broken = dict(QWEN3)
    del broken["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ConfigError, match=r"config\.json.*'vocab_size' is missing"):
        load_shape(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        load_shape(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3, model_type="gpt2")))
    with pytest.raises(ConfigError, match="model_type = 'gpt2'"):
        load_shape(tmp_path)

"""eddyrl/plan/shapes.py: parameter counts equal transformers' own, read from config.json alone."""

import json

import pytest
import torch

from eddyrl.errors import ConfigError
from eddyrl.plan.shapes import load_shape, shape_from_config

QWEN3 = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=1000,
             tie_word_embeddings=True)
CASES = {
    "qwen3-0.6b-layers-tied": QWEN3,
    "qwen3-8b-layers-untied": dict(QWEN3, hidden_size=4096, intermediate_size=12288,
                                   num_attention_heads=32, num_hidden_layers=1,
                                   tie_word_embeddings=False),
    "qwen3-attention-bias": dict(QWEN3, attention_bias=True, hidden_size=256,
                                 intermediate_size=512, head_dim=64),
    "qwen3-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512,
                      moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=500, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=500, tie_word_embeddings=False),
    "llama-mlp-bias": dict(model_type="llama", hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                           vocab_size=500, mlp_bias=True, attention_bias=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parameter_count_is_transformers_own(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(CASES[name])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):  # shapes only: no memory, milliseconds
        model = AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(CASES[name])
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    layers = model.model.layers
    assert [shape.layer_parameters(i) for i in range(len(layers))] == [
        sum(p.numel() for p in layer.parameters()) for layer in layers]


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

"""The cost model's parameter counts, read from a Hugging Face config, equal transformers' own
for small models of each type and for the shipped tiny model. (The rest of the cost model, no
model built: test_cost_model.py.)"""

import json
from pathlib import Path

import pytest
from small_configs import small_config

from eddyrl.scheduler.hardware import model_from_hf_config

TINY_CONFIG = Path(__file__).resolve().parents[3] / "eddyrl/assets/tiny_warmstart/config.json"


@pytest.mark.parametrize("config", [
    small_config("qwen2"), small_config("qwen3"), small_config("llama"),
    small_config("qwen3", tie_word_embeddings=True),
    small_config("qwen3_moe", moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2),
    json.loads(TINY_CONFIG.read_text()),
], ids=["qwen2", "qwen3", "llama", "qwen3-tied", "qwen3-moe", "tiny"])
def test_parameter_count_equals_transformers(config):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.for_model(**config)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert model_from_hf_config("small", config).total_params == sum(
        parameter.numel() for parameter in hf_model.parameters())

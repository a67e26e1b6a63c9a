"""The LoRA weight update's pure logic (no model): the factors' names, the merge, what a sync
sends in each form, and the settings refused before anything starts."""

import sys

import pytest
import torch

from eddyrl.engines import low_rank
from eddyrl.engines.config import LoraConfig
from eddyrl.engines.training import lora as lora_layers
from eddyrl.errors import ConfigError

MODULE = "model.layers.0.self_attn.q_proj"


def _state(gen):
    """A model state in state-dict order: a plain weight, then one LoRA layer."""
    return [("model.embed_tokens.weight", torch.randn(5, 4, generator=gen)),
            (f"{MODULE}.base_layer.weight", torch.randn(6, 4, generator=gen)),
            (f"{MODULE}.lora_A.default.weight", torch.randn(2, 4, generator=gen)),
            (f"{MODULE}.lora_B.default.weight", torch.randn(6, 2, generator=gen))]


def test_factors_carry_the_scaled_delta_and_merged_weights_add_it():
    state = _state(torch.Generator().manual_seed(0))
    base, down, up = (t for _, t in state[1:])
    factors = dict(lora_layers.weight_update(
        [(n, t) for n, t in state if lora_layers.is_adapter(n)], 8.0, factors=True))
    assert list(factors) == list(low_rank.factor_names(f"{MODULE}.weight"))
    assert torch.equal(factors[f"{MODULE}.weight.lora_down"], down)
    assert torch.equal(factors[f"{MODULE}.weight.lora_up"], 8.0 * up)

    merged = dict(lora_layers.weight_update(state, 8.0, factors=False))
    assert list(merged) == ["model.embed_tokens.weight", f"{MODULE}.weight"]  # HF names
    torch.testing.assert_close(merged[f"{MODULE}.weight"], base + 8.0 * up @ down)
    torch.testing.assert_close(low_rank.merged(base, *factors.values()),
                               merged[f"{MODULE}.weight"])


def test_an_update_with_one_factor_of_two_is_refused():
    assert low_rank.targets(["x.weight", "a.weight.lora_down", "a.weight.lora_up"]) == \
        {"a.weight"}
    with pytest.raises(ValueError, match="one factor of the two"):
        low_rank.targets(["a.weight.lora_down"])


def test_the_scale_is_alpha_over_rank():
    assert lora_layers.scaling(LoraConfig(rank=8, alpha=16.0)) == 2.0


def test_a_missing_peft_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ConfigError, match=r"'train.lora.rank' = 16 .*pip install"):
        lora_layers.require_peft(16)


@pytest.mark.parametrize("overrides, message", [
    (["train.lora.rank=-1"], "train.lora.rank"),
    (["train.lora.rank=8", "train.lora.target_modules=[]"], "train.lora.target_modules"),
    (["train.lora.rank=8", "elastic.enabled=true", "rollout.num_workers=2"],
     "train.lora.rank = 8: a joined replica"),
])
def test_bad_lora_settings_are_refused_by_name(overrides, message):
    from eddyrl.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)

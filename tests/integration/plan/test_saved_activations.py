"""eddyrl/plan/activations.py against autograd: the per-layer activation formula equals what
torch's saved-tensor hooks see in a real transformers Qwen3 layer (small models built here),
in fp32 and bf16, with sdpa, a custom mask or eager attention, and with LoRA adapters. (The
rest of the memory plan, arithmetic on the shapes: test_training_memory.py.)"""

import pytest

from eddyrl.plan.activations import layer_bytes_per_token
from eddyrl.plan.shapes import ModelShape

SMALL = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=128, tie_word_embeddings=True)


def _saved_bytes(layers, dtype, implementation, tokens, masked, lora_targets=()):
    """Bytes of the distinct non-parameter storages autograd saves in a Qwen3 decoder."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(num_hidden_layers=layers, attn_implementation=implementation, **SMALL)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype)
    if lora_targets:
        from eddyrl.engines.config import LoraConfig
        from eddyrl.engines.training.lora import add_adapters

        add_adapters(model, LoraConfig(rank=8, target_modules=list(lora_targets)))
        model.to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 128, (1, tokens))
    mask = None
    if masked:  # a custom 4D mask, as the packed layout passes: sdpa repeats k and v first
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
        if implementation == "eager":
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask,
                                                                   torch.finfo(dtype).min)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    return sum(seen.values())


@pytest.mark.integration  # builds small transformers models
@pytest.mark.parametrize("dtype_name,implementation,masked,attention", [
    ("fp32", "sdpa", False, "flash"), ("bf16", "sdpa", False, "flash"),
    ("fp32", "sdpa", True, "mask"), ("bf16", "sdpa", True, "mask"),
    ("fp32", "eager", True, "eager"),
    ("bf16", "eager", True, "eager")])
def test_saved_activations_equal_the_layer_formula(dtype_name, implementation, masked,
                                                   attention):
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    tokens = 48
    per_layer = (_saved_bytes(2, dtype, implementation, tokens, masked)
                 - _saved_bytes(1, dtype, implementation, tokens, masked))
    shape = ModelShape(hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2,
                       head_dim=64, vocab=128, tied_embeddings=True)
    c = 4 if dtype_name == "fp32" else 2
    assert per_layer == layer_bytes_per_token(shape, c, attention, tokens) * tokens


@pytest.mark.integration  # builds small transformers models
def test_saved_activations_with_lora_equal_the_layer_formula():
    """Frozen linears keep no input, adapted ones keep it and lora_A's [rank] output."""
    import torch

    pytest.importorskip("peft")
    from eddyrl.plan.activations import LayerTraining

    targets = ("q_proj", "v_proj", "down_proj")
    tokens = 48
    per_layer = (_saved_bytes(2, torch.float32, "sdpa", tokens, False, targets)
                 - _saved_bytes(1, torch.float32, "sdpa", tokens, False, targets))
    shape = ModelShape(hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2,
                       head_dim=64, vocab=128, tied_embeddings=True)
    train = LayerTraining(lora_rank=8, lora_targets=targets)
    assert per_layer == layer_bytes_per_token(shape, 4, "flash", tokens, train) * tokens

"""The tiny policy builds offline, has heads the vLLM CPU backend accepts, and runs."""

import torch

from eddyrl.models.tiny import TinyModelConfig, build_tiny_model, build_tokenizer


def test_tiny_model_shape_and_forward():
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    config = model.config
    assert config.head_dim >= 32
    assert config.model_type == "qwen3"
    assert config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 2_000_000  # a few MB on disk

    ids = torch.tensor([tokenizer.encode("add 3 5 8", add_special_tokens=False)])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights():
    tokenizer = build_tokenizer()
    config = TinyModelConfig(num_hidden_layers=1)
    first = build_tiny_model(tokenizer, seed=7, config=config)
    second = build_tiny_model(tokenizer, seed=7, config=config)
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)

"""Shared fixtures: a tiny random Qwen3 + character tokenizer saved as an HF directory."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from eddyrl.models.tiny import build_tiny_model, build_tokenizer

    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)

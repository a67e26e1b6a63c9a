"""The SFT warm start trains only on responses and saves a checkpoint transformers can load."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eddyrl.models.tiny import TinyModelConfig, build_tokenizer
from eddyrl.tasks.arith import ArithTaskConfig
from eddyrl.tasks.sft import IGNORE_INDEX, demonstration_batch, run_sft

CPU = torch.device("cpu")


def test_labels_cover_only_the_response_and_end_token():
    tokenizer = build_tokenizer()
    rows = [{"prompt": "add 3 5 8", "answer": "16"}, {"prompt": "add 1 2", "answer": "3"}]
    batch = demonstration_batch(tokenizer, rows, CPU, stop_early=[False, True])
    first_labels = [t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX]
    assert tokenizer.decode(first_labels) == "3 8 16 = 16<|im_end|>"
    second_labels = [t for t in batch["labels"][1].tolist() if t != IGNORE_INDEX]
    assert tokenizer.decode(second_labels) == "1 = 1<|im_end|>"  # stopped one number short
    # the shorter row is right padded and its padding is masked out of attention and loss
    assert batch["attention_mask"][1, -1] == 0
    assert batch["labels"][1, -1] == IGNORE_INDEX


def test_run_sft_saves_a_loadable_checkpoint(tmp_path):
    torch.set_num_threads(1)
    metrics = run_sft(
        tmp_path,
        steps=2,
        lr=1e-3,
        batch_size=4,
        seed=0,
        device=CPU,
        task=ArithTaskConfig(max_terms=3),
        model_config=TinyModelConfig(num_hidden_layers=1),
        eval_count=4,
    )
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert (tmp_path / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.num_hidden_layers == 1
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id


@pytest.mark.integration  # runs the command in-process: it builds and trains a model
def test_eddy_sft_cipher_with_a_model_size_and_stop_at(tmp_path, capsys):
    from eddyrl.cli import main

    threads = torch.get_num_threads()
    out = tmp_path / "warm"
    try:
        code = main(["sft", "--task", "cipher", "--steps", "4", "--stop-at", "2",
                     "--batch-size", "4", "--hidden-size", "64", "--layers", "1",
                     "--intermediate-size", "96",
                     "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the command sets its own (--threads, default 1)
    assert code == 0
    metrics = json.loads(capsys.readouterr().out)
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 1)
    assert (model.config.intermediate_size, model.config.num_attention_heads) == (96, 2)
    assert AutoTokenizer.from_pretrained(out).eos_token_id == model.generation_config.eos_token_id


def test_eddy_sft_refuses_a_bad_size_or_stop_at(tmp_path, capsys):
    from eddyrl.cli import main

    assert main(["sft", "--hidden-size", "100", "--out", str(tmp_path)]) == 2
    assert "multiple of 32" in capsys.readouterr().err
    assert main(["sft", "--steps", "3", "--stop-at", "5", "--out", str(tmp_path)]) == 2
    assert "--stop-at 5" in capsys.readouterr().err


def test_model_size_defaults_are_the_shipped_shape():
    assert TinyModelConfig.of_size() == TinyModelConfig()
    wider = TinyModelConfig.of_size(192, 6)
    assert (wider.num_attention_heads, wider.intermediate_size, wider.head_dim) == (6, 576, 32)

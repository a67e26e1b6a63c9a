"""The SFT warm start trains the tiny model and saves a checkpoint transformers can load, called
as a function (`run_sft`) and as `eddy sft --task cipher` with a model size and --stop-at. (Its
labels and the sizes it refuses: test_sft.py.)"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eddyrl.models.tiny import TinyModelConfig
from eddyrl.tasks.arith import ArithTaskConfig
from eddyrl.tasks.sft import run_sft

CPU = torch.device("cpu")


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

"""The SFT warm start trains only on responses and saves a checkpoint transformers can load."""

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

"""The SFT warm start trains only on responses: its labels cover the response and the end token
alone; `eddy sft`'s model sizes, and the ones it refuses. (Training and the checkpoint it saves:
test_sft_checkpoint.py.)"""

import torch

from eddyrl.models.tiny import TinyModelConfig, build_tokenizer
from eddyrl.tasks.sft import IGNORE_INDEX, demonstration_batch

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

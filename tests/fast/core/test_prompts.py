"""Prompt rows: tokenization, length limits (error or truncate), seeded batches, bad files."""

import json

import pytest

from eddyrl.errors import ConfigError
from eddyrl.models.tiny import build_tokenizer
from eddyrl.tasks.config import DataConfig
from eddyrl.tasks.prompts import PromptSet, load_splits


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_long_prompt_is_an_error_naming_file_and_row(tokenizer):
    rows = [{"prompt": "add 1 2", "answer": "3"}, {"prompt": "add " + "9 " * 60, "answer": "0"}]
    with pytest.raises(ConfigError, match=r"data.jsonl: row 2: prompt is \d+ tokens"):
        PromptSet.from_rows(rows, "data.jsonl", tokenizer, 40, "error")


def test_long_prompt_can_be_truncated_and_counted(tokenizer):
    rows = [{"prompt": "add 1 2", "answer": "3"}, {"prompt": "add " + "9 " * 60, "answer": "0"}]
    prompts = PromptSet.from_rows(rows, "data.jsonl", tokenizer, 40, "truncate")
    assert prompts.truncated == 1
    long = prompts.prompts[1].prompt_ids
    assert len(long) == 40
    assert tokenizer.decode(list(long)).endswith("<|im_start|>assistant\n")


def test_batches_are_seeded_and_cover_an_epoch(tokenizer):
    rows = [{"prompt": f"add {i} 1", "answer": str(i + 1)} for i in range(10)]
    prompts = PromptSet.from_rows(rows, "x", tokenizer, 64, "error")
    a = [(e, [p.index for p in b]) for (e, b), _ in zip(prompts.batches(4, seed=1), range(6))]
    b = [(e, [p.index for p in b]) for (e, b), _ in zip(prompts.batches(4, seed=1), range(6))]
    assert a == b
    assert [e for e, _ in a] == [0, 0, 0, 1, 1, 1] and [len(p) for _, p in a] == [4, 4, 2] * 2
    assert sorted(a[0][1] + a[1][1] + a[2][1]) == list(range(10)) and a[:3] != a[3:]


def test_missing_field_names_file_and_row(tmp_path):
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(json.dumps({"prompt": "add 1", "answer": "1"}) + "\n" +
                     json.dumps({"prompt": "add 2"}) + "\n")
    evals.write_text(json.dumps({"prompt": "add 1", "answer": "1"}) + "\n")
    config = DataConfig(train_path=str(train), eval_path=str(evals))
    with pytest.raises(ConfigError, match=r"train.jsonl: row 2: missing field 'answer'"):
        load_splits(config, tmp_path, seed=0)
    with pytest.raises(ConfigError, match="does not exist"):
        load_splits(DataConfig(train_path=str(tmp_path / "no.jsonl"), eval_path=str(evals)),
                    tmp_path, seed=0)


def test_builtin_task_is_generated(tmp_path):
    train, evals, train_src, _ = load_splits(DataConfig(train_size=50, eval_size=10),
                                             tmp_path, seed=0)
    assert len(train) == 50 and len(evals) == 10 and train_src.endswith("train.jsonl")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}

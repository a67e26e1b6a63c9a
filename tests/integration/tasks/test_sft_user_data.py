"""`eddy sft --model DIR --data FILE`: the user's own model on the user's prompt -> response
file. The loss is on the response only, prompts are rendered as RL's rollouts render them,
the output loads in transformers and passes `eddy train`'s model checks, and every bad input
is refused naming the file, the row and the key. (A --model that is not a model directory,
refused before the tiny model is needed: test_sft_not_a_model.py.)"""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from eddyrl.cli import main
from eddyrl.errors import ConfigError
from eddyrl.models.config import ModelConfig, load_tokenizer
from eddyrl.tasks.prompts import prompt_ids
from eddyrl.tasks.sft import IGNORE_INDEX, pad_batch
from eddyrl.tasks.sft_data import SftFileConfig, tokenize_demonstrations
from eddyrl.tasks.sft_user import MARKER

from sft_user_cases import CPU, sft, sum_rows, write_jsonl


@pytest.fixture(autouse=True)
def one_thread():  # on a busy machine, torch's threads spin against each other: far slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_jsonl_file_trains_and_the_output_loads_where_rl_loads_it(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "sums.jsonl", sum_rows(72))
    out = tmp_path / "warm"
    summary = sft(tiny_model_dir, data, out, epochs=4,
                  file=SftFileConfig(eval_fraction=0.1))
    assert (summary["rows"], summary["held_out_rows"], summary["steps"]) == (65, 7, 36)
    assert summary["loss_last"] < 0.6 * summary["loss_first"]
    assert summary["held_out_loss_after"] < 0.6 * summary["held_out_loss_before"]
    # plain transformers, and the start-up checks of `eddy train model.path=OUT`
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert ModelConfig(path=str(out)).resolve() == str(out)
    load_tokenizer(str(out))
    assert json.loads((out / MARKER).read_text())["steps"] == 36
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(start.lm_head.weight, model.lm_head.weight)


def test_a_parquet_file_with_chat_prompts_and_nested_keys_through_the_cli(
        tiny_model_dir, tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"conversation": [{"role": "system", "content": "you add"},
                              {"role": "user", "content": row["prompt"]}],
             "label": {"text": row["response"]}} for row in sum_rows(12)]
    data = tmp_path / "sums.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "warm"
    code = main(["sft", "--model", tiny_model_dir, "--data", str(data), "--out", str(out),
                 "--prompt-key", "conversation", "--response-key", "label.text",
                 "--steps", "3", "--batch-size", "4", "--lr", "1e-3", "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "rows: 12 trained on" in printed and "loss " in printed
    assert f"eddy train model.path={out}" in printed
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 4


def test_the_loss_is_the_mean_over_response_tokens_only(tiny_model_dir, tmp_path):
    rows = [{"prompt": "add 1 2", "response": "1 + 2 = 3"},
            {"prompt": [{"role": "user", "content": "add 10 20 30"}], "response": "60"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = tokenize_demonstrations(tokenizer, [(i + 1, r["prompt"], r["response"])
                                                   for i, r in enumerate(rows)],
                                       "rows", max_length=256, overflow="error")
    for example, row in zip(examples, rows):  # the prompt exactly as a rollout renders it
        prompt = prompt_ids(tokenizer, row["prompt"])
        assert list(example.ids[:len(prompt)]) == prompt
        assert set(example.labels[:len(prompt)]) == {IGNORE_INDEX}
        learned = [t for t in example.labels if t != IGNORE_INDEX]
        assert tokenizer.decode(learned) == row["response"] + tokenizer.eos_token
    # by hand: -log p(token t | tokens < t) over the response tokens of both rows, averaged
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = pad_batch([(e.ids, e.labels) for e in examples], tokenizer.pad_token_id, CPU)
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=batch["input_ids"],
                                   attention_mask=batch["attention_mask"]).logits, dim=-1)
    terms = [-logp[i, t - 1, e.labels[t]].item() for i, e in enumerate(examples)
             for t in range(len(e.ids)) if e.labels[t] != IGNORE_INDEX]
    by_hand = sum(terms) / len(terms)
    every_token = [-logp[i, t - 1, e.ids[t]].item() for i, e in enumerate(examples)
                   for t in range(1, len(e.ids))]
    assert abs(by_hand - sum(every_token) / len(every_token)) > 0.01  # the pin can fail
    # the training loop's first loss: one step, one batch holding both rows
    data = write_jsonl(tmp_path / "two.jsonl", rows)
    summary = sft(tiny_model_dir, data, tmp_path / "out", steps=1, batch_size=2)
    assert summary["loss_first"] == pytest.approx(by_hand, rel=1e-5)


def test_a_long_row_is_refused_by_name_or_its_response_cut(tiny_model_dir, tmp_path):
    rows = sum_rows(3)
    rows[1]["response"] = "9" * 60
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(ConfigError, match=r"long.jsonl: row 2: longer than --max-length 50; "
                       r"it is 87 tokens .*--overflow truncate"):
        sft(tiny_model_dir, data, tmp_path / "out", steps=1,
            file=SftFileConfig(max_length=50))
    assert not (tmp_path / "out").exists()
    summary = sft(tiny_model_dir, data, tmp_path / "out", steps=1,
                  file=SftFileConfig(max_length=50, overflow="truncate"))
    assert summary["truncated_rows"] == 1
    with pytest.raises(ConfigError, match="prompt alone is 26 tokens"):
        sft(tiny_model_dir, data, tmp_path / "out2", steps=1,
            file=SftFileConfig(max_length=20, overflow="truncate"))
    with pytest.raises(ConfigError, match=r"--max-length 999: the model's positions cover 256"):
        sft(tiny_model_dir, data, tmp_path / "out3", steps=1, file=SftFileConfig(max_length=999))


@pytest.mark.parametrize("name, text, message", [
    ("missing.jsonl", None, r"data file '.*missing.jsonl' does not exist"),
    ("rows.csv", "prompt,response\n", r"'.*rows.csv' has suffix '.csv'; readable suffixes"),
    ("typo.jsonl", '{"prompt": "add 1 2", "response": "3"}\n{"prompt": "add 2", "respose": "2"}\n',
     r"typo.jsonl: row 2: no key 'response'; did you mean 'respose'\? \(the row's keys: "
     r"'prompt', 'respose'\); give --response-key"),
    ("empty.jsonl", '{"prompt": "add 1 2", "response": ""}\n',
     r"empty.jsonl: row 1: key 'response' is empty"),
    ("number.jsonl", '{"prompt": "add 1 2", "response": 3}\n',
     r"number.jsonl: row 1: key 'response' must be a string, got int"),
    ("blank.jsonl", "\n", r"blank.jsonl' holds no rows"),
])
def test_a_bad_file_is_refused_naming_the_file_row_and_key(tiny_model_dir, tmp_path, name,
                                                            text, message):
    data = tmp_path / name
    if text is not None:
        data.write_text(text)
    with pytest.raises(ConfigError, match=message):
        sft(tiny_model_dir, data, tmp_path / "out", steps=1)
    assert not (tmp_path / "out").exists()


def test_out_is_never_a_users_directory_nor_the_model(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "sums.jsonl", sum_rows(4))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"--out '.*mine': is not empty and is not an eddy "
                       r"sft output \(it has no eddy_sft.json\): it holds 'config.json'"):
        sft(tiny_model_dir, data, mine, steps=1)
    assert (mine / "config.json").read_text() == "{}"
    with pytest.raises(ConfigError, match="is the --model directory"):
        sft(tiny_model_dir, data, tiny_model_dir, steps=1)
    # an earlier eddy sft output is replaced
    sft(tiny_model_dir, data, tmp_path / "warm", steps=1)
    assert sft(tiny_model_dir, data, tmp_path / "warm", steps=2)["steps"] == 2

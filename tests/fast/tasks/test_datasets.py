"""Dataset formats: plain / gsm8k / dapo_math rows, field mapping with dotted paths, JSON lines
and Parquet, and bad input that names the file, the 1-based row and the field."""

import json
import sys
from pathlib import Path

import pytest

from eddyrl.errors import ConfigError
from eddyrl.models.tiny import build_tokenizer
from eddyrl.tasks.config import DataConfig, DataFields
from eddyrl.tasks.dataset import read_records, read_rows
from eddyrl.tasks.formats import FORMATS, row_format
from eddyrl.tasks.prompts import PromptSet, load_splits, prompt_ids

DATA = Path(__file__).resolve().parents[2] / "data"
QUESTION, ANSWER = "add 2 3", "5"

# The same problem in each layout, and in a custom one read through data.fields.
SAME_PROBLEM = {
    "plain": ({"prompt": QUESTION, "answer": ANSWER}, {}),
    "gsm8k": ({"question": QUESTION, "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}, {}),
    "dapo_math": ({"data_source": "math_dapo", "prompt": [{"content": QUESTION, "role": "user"}],
                   "ability": "MATH",
                   "reward_model": {"ground_truth": ANSWER, "style": "rule-lighteval/MATH_v2"},
                   "extra_info": {"index": "0"}}, {}),
    "custom": ({"problem": {"text": QUESTION}, "meta": {"gold": {"value": ANSWER}}},
               {"prompt": "problem.text", "answer": "meta.gold.value"}),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _write_parquet(path, records):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _fmt(name, fields):
    return row_format("plain" if name == "custom" else name, fields.get("prompt"),
                      fields.get("answer"))


@pytest.mark.parametrize("name", SAME_PROBLEM)
def test_each_format_gives_the_same_prompt_and_answer(name, tmp_path, tokenizer):
    record, fields = SAME_PROBLEM[name]
    rows = read_rows(_write_jsonl(tmp_path / "rows.jsonl", [record]), _fmt(name, fields))
    assert rows[0]["answer"] == ANSWER
    (prompt,) = PromptSet.from_rows(rows, "rows.jsonl", tokenizer, 64, "error").prompts
    plain = PromptSet.from_rows([{"prompt": QUESTION, "answer": ANSWER}], "x", tokenizer, 64,
                                "error").prompts[0]
    assert prompt == plain  # same text, answer and token ids


def test_format_and_dotted_fields_come_from_the_config(tmp_path):
    record, _ = SAME_PROBLEM["custom"]
    path = _write_jsonl(tmp_path / "custom.jsonl", [record, record])
    config = DataConfig(train_path=str(path), eval_path=str(path),
                        fields=DataFields(prompt="problem.text", answer="meta.gold.value"))
    config.validate("data")
    train, evals, _, _ = load_splits(config, tmp_path, seed=0)
    assert [r["prompt"] for r in train] == [QUESTION] * 2 and evals[0]["answer"] == ANSWER
    assert train[0]["meta"] == record["meta"]  # other fields are kept


def test_shipped_gsm8k_and_dapo_samples_hold_the_same_problems():
    gsm8k = read_rows(DATA / "gsm8k_sample.jsonl", FORMATS["gsm8k"])
    dapo = read_rows(DATA / "dapo_math_sample.jsonl", FORMATS["dapo_math"])
    assert [r["answer"] for r in gsm8k] == [r["answer"] for r in dapo] == ["26", "110", "180",
                                                                          "36"]
    for g, d in zip(gsm8k, dapo):
        assert g["question"] in d["prompt"][0]["content"]


@pytest.mark.parametrize("name, fmt", [("gsm8k_sample", "gsm8k"),
                                       ("dapo_math_sample", "dapo_math")])
def test_parquet_and_jsonl_give_identical_rows(name, fmt):
    pytest.importorskip("pyarrow")
    jsonl = read_rows(DATA / f"{name}.jsonl", FORMATS[fmt])
    assert read_rows(DATA / f"{name}.parquet", FORMATS[fmt]) == jsonl


def test_shipped_samples_match_their_generator(tmp_path):
    pytest.importorskip("pyarrow")
    sys.path.insert(0, str(DATA))
    try:
        import make_samples
    finally:
        sys.path.remove(str(DATA))
    make_samples.write_samples(tmp_path)
    for path in sorted(tmp_path.iterdir()):
        shipped = DATA / path.name
        assert list(read_records(path)) == list(read_records(shipped)), \
            f"{shipped} is out of date: run python tests/data/make_samples.py"


_DROP = object()


def _dapo(**changes):
    """The good DAPO-Math record with `a__b=value` set (or dropped with _DROP)."""
    record = json.loads(json.dumps(SAME_PROBLEM["dapo_math"][0]))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = record
        for key in parents:
            node = node[key]
        if value is _DROP:
            del node[leaf]
        else:
            node[leaf] = value
    return record


BAD_ROWS = [
    ("dapo_math", _dapo(reward_model__ground_truth=_DROP),
     "missing field 'reward_model.ground_truth'"),
    ("dapo_math", _dapo(reward_model="34"),
     "field 'reward_model' must be an object to hold 'reward_model.ground_truth', got str"),
    ("dapo_math", _dapo(reward_model__ground_truth=34),
     "field 'reward_model.ground_truth' must be str, got int"),
    ("dapo_math", _dapo(reward_model__ground_truth="  "),
     "field 'reward_model.ground_truth' is empty"),
    ("dapo_math", _dapo(prompt=[]), "field 'prompt' must be str or a list of chat messages"),
    ("dapo_math", _dapo(prompt=[{"role": "user"}]),
     "field 'prompt': message 1 needs 'content' as str, got nothing"),
    ("dapo_math", _dapo(prompt=7), "field 'prompt' must be str or a list of chat messages"),
    ("gsm8k", {"question": "q", "answer": "no final line"},
     "field 'answer' has no final line '#### <answer>' (format 'gsm8k')"),
    ("gsm8k", {"question": "q", "answer": "work\n####  "}, "field 'answer' is empty"),
    ("gsm8k", {"prompt": "q", "answer": "#### 1"}, "missing field 'question'"),
    ("plain", {"prompt": "", "answer": "1"}, "field 'prompt' is empty"),
    ("plain", {"prompt": "q", "answer": None}, "field 'answer' must be str, got NoneType"),
]


# In Parquet every row has every column: a missing value reads as None (null).
BAD_PARQUET_ROWS = [
    ("dapo_math", _dapo(reward_model__ground_truth=None),
     "field 'reward_model.ground_truth' must be str, got NoneType"),
    ("dapo_math", _dapo(reward_model__ground_truth=""),
     "field 'reward_model.ground_truth' is empty"),
    ("dapo_math", _dapo(prompt=None), "field 'prompt' must be str or a list of chat messages"),
    ("gsm8k", {"question": "q", "answer": "no final line"}, "field 'answer' has no"),
]


@pytest.mark.parametrize("suffix, fmt, bad, message",
                         [("jsonl", *case) for case in BAD_ROWS]
                         + [("parquet", *case) for case in BAD_PARQUET_ROWS])
def test_bad_row_names_file_row_and_field(tmp_path, suffix, fmt, bad, message):
    good = SAME_PROBLEM[fmt][0]
    write = _write_jsonl if suffix == "jsonl" else _write_parquet
    path = write(tmp_path / f"bad.{suffix}", [good, good, bad])
    with pytest.raises(ValueError) as error:
        read_rows(path, FORMATS[fmt])
    assert str(error.value).startswith(f"{path}: row 3: {message}")


def test_missing_file_and_unknown_suffix_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"data file '.*nope\.jsonl' does not exist"):
        read_rows(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"data file '.*rows\.csv' has suffix '\.csv'; "
                                         r"readable suffixes: \.jsonl, \.json, \.parquet"):
        read_rows(tmp_path / "rows.csv")
    with pytest.raises(ConfigError, match=r"'data.train_path'.*rows\.csv.*suffix '\.csv'"):
        DataConfig(train_path="rows.csv", eval_path="rows.jsonl").validate("data")
    with pytest.raises(ConfigError, match=r"data.train_path: data file '.*' does not exist"):
        load_splits(DataConfig(train_path=str(tmp_path / "no.parquet"),
                               eval_path=str(tmp_path / "no.jsonl")), tmp_path, seed=0)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow...` now fails
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"rows\.parquet' is Parquet, which needs pyarrow: "
                                         r"pip install 'eddyrl\[data\]'"):
        read_rows(path)


def test_json_suffix_is_read_as_json_lines(tmp_path):
    path = _write_jsonl(tmp_path / "rows.json", [SAME_PROBLEM["plain"][0]])
    assert read_rows(path)[0]["answer"] == ANSWER


@pytest.mark.parametrize("overrides, message", [
    ({"format": "csv"}, "'data.format' = 'csv' is not allowed; choose one of 'plain', 'gsm8k', "
                        "'dapo_math'"),
    ({"fields": DataFields(answer="reward_model..x")}, "'data.fields.answer'"),
    ({"format": "gsm8k", "train_path": None, "eval_path": None},
     "data.format / data.fields describe data files"),
])
def test_data_config_errors_name_the_key(overrides, message):
    config = DataConfig(train_path="a.jsonl", eval_path="b.parquet")
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ConfigError, match=None) as error:
        config.validate("data")
    assert message in str(error.value)


class _NoTemplate:
    """A tokenizer without a chat template: one id per character."""

    chat_template = None

    def __call__(self, text):
        if isinstance(text, list):  # a batch, as fast tokenizers take it
            return {"input_ids": [[ord(c) for c in t] for t in text]}
        return {"input_ids": [ord(c) for c in text]}


def test_chat_messages_without_a_template_join_their_contents():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"}]
    assert prompt_ids(_NoTemplate(), messages) == [ord(c) for c in "be brief\n\n1+1"]
    assert prompt_ids(_NoTemplate(), "1+1") == [ord(c) for c in "1+1"]


def test_chat_messages_with_a_template_keep_their_roles(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"}]
    text = tokenizer.decode(prompt_ids(tokenizer, messages))
    assert text.index("system") < text.index("user") < text.index("assistant")


def test_prompts_tokenized_as_a_batch_are_tokenized_as_one_by_one(tokenizer):
    """PromptSet tokenizes its rows in one batch (`prompts_ids`); each prompt's ids are what
    `prompt_ids` gives it alone, with and without a chat template."""
    from eddyrl.tasks.arith import ArithTaskConfig, generate_rows
    from eddyrl.tasks.prompts import prompts_ids

    rows = generate_rows(300, 0, "train", ArithTaskConfig())
    prompts = [row["prompt"] for row in rows] + [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"}], ""]
    assert prompts_ids(tokenizer, prompts) == [prompt_ids(tokenizer, p) for p in prompts]
    assert prompts_ids(_NoTemplate(), prompts) == [prompt_ids(_NoTemplate(), p) for p in prompts]
    assert prompts_ids(tokenizer, []) == []

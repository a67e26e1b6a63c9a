"""Bad data files: missing, unreadable, malformed rows, missing fields, empty, prompts too long.
Each fails at start-up naming the config key, the file, the 1-based row and the field."""

import json

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError
from eddyrl.tasks.prompts import PromptSet, load_splits


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path, columns):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


GOOD = [{"prompt": "add 1 2", "answer": "3"}]


def splits_error(tmp_path, train, *overrides) -> str:
    """The error of loading `train` (eval: a good file) as `data.train_path`."""
    eval_path = write_jsonl(tmp_path / "eval.jsonl", GOOD)
    config = load_config(overrides=[f"data.train_path={train}", f"data.eval_path={eval_path}",
                                    *overrides])
    with pytest.raises(ConfigError) as error:
        load_splits(config.data, tmp_path / "generated", seed=0)
    return str(error.value)


def test_missing_data_file(tmp_path):
    path = tmp_path / "train.jsonl"
    assert splits_error(tmp_path, path) == f"data.train_path: data file '{path}' does not exist"


def test_malformed_json_line_names_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD[0], '{"prompt": "add 2 2", "answer": '])
    assert splits_error(tmp_path, path) == (
        f"data.train_path: {path}: row 2: not valid JSON (Expecting value); expected one JSON "
        "object per line")


def test_row_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ["[1, 2]"])
    assert splits_error(tmp_path, path) == (
        f"data.train_path: {path}: row 1: expected a JSON object (one per line), got list")


def test_jsonl_row_missing_its_answer_names_file_row_and_field(tmp_path):
    # a blank line still counts, so row numbers are line numbers
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD[0], "", {"prompt": "add 2 2"}])
    assert splits_error(tmp_path, path) == (
        f"data.train_path: {path}: row 3: missing field 'answer' (fields there: 'prompt'); "
        "format 'plain': set data.fields.answer if the rows keep the answer under another name")


def test_parquet_row_with_a_null_prompt(tmp_path):
    path = write_parquet(tmp_path / "train.parquet",
                         {"prompt": ["add 1 2", None], "answer": ["3", "4"]})
    assert splits_error(tmp_path, path).startswith(
        f"data.train_path: {path}: row 2: field 'prompt' must be str or a list of chat "
        "messages")


def test_field_mapping_to_a_missing_column(tmp_path):
    path = write_parquet(tmp_path / "train.parquet",
                         {"prompt": ["add 1 2"], "solution": ["3"]})
    assert splits_error(tmp_path, path, "data.fields.answer=solutoin") == (
        f"data.train_path: {path}: row 1: missing field 'solutoin' (fields there: 'prompt', "
        "'solution'); format 'plain': set data.fields.answer if the rows keep the answer "
        "under another name")


def test_gsm8k_answer_without_its_final_line(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"question": "1 + 2?", "answer": "1 + 2 = 3\n#### 3"},
        {"question": "2 + 2?", "answer": "2 + 2 = 4"}])
    assert splits_error(tmp_path, path, "data.format=gsm8k") == (
        f"data.train_path: {path}: row 2: field 'answer' has no final line '#### <answer>' "
        "(format 'gsm8k')")


def test_unreadable_parquet_file(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", {"prompt": ["add 1 2"], "answer": ["3"]})
    path = tmp_path / "train.parquet"
    path.write_bytes(good.read_bytes()[:40])  # cut short: no footer
    assert splits_error(tmp_path, path).startswith(
        f"data.train_path: data file '{path}' is not a readable Parquet file (ArrowInvalid")


def test_empty_data_file(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [])
    assert splits_error(tmp_path, path) == f"data.train_path: data file '{path}' holds no rows"


def test_unreadable_suffix_is_refused_with_the_config(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[f"data.train_path={tmp_path}/rows.csv",
                               f"data.eval_path={tmp_path}/rows.jsonl"])
    assert str(error.value).startswith(
        f"config key 'data.train_path': data file '{tmp_path}/rows.csv' has suffix '.csv'; "
        "readable suffixes: .jsonl, .json, .parquet")


def test_prompt_longer_than_max_prompt_tokens_names_the_row():
    from eddyrl.models.tiny import build_tokenizer

    rows = [{"prompt": "add 1 2", "answer": "3"}, {"prompt": "add " + "9 " * 40, "answer": "1"}]
    with pytest.raises(ConfigError) as error:
        PromptSet.from_rows(rows, "train.jsonl", build_tokenizer(), 32, "error")
    assert str(error.value).startswith("train.jsonl: row 2: prompt is ")
    assert str(error.value).endswith("tokens, more than data.max_prompt_tokens=32 (raise it, or "
                                     "set data.prompt_overflow=truncate)")


class CountingTokenizer:
    """The tiny tokenizer, recording the length of every prompt it is asked to render (one
    conversation, or a batch of them) and tokenize."""

    def __init__(self):
        from eddyrl.models.tiny import build_tokenizer

        self.inner, self.seen = build_tokenizer(), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply_chat_template(self, conversations, **kwargs):
        batch = conversations if conversations and isinstance(conversations[0], list) \
            else [conversations]
        self.seen.extend(sum(len(m["content"]) for m in messages) for messages in batch)
        return self.inner.apply_chat_template(conversations, **kwargs)

    def __call__(self, texts, **kwargs):  # the rendered prompts, recorded when rendered
        return self.inner(texts, **kwargs)


HUGE = "add " + "9 " * 2_000_000  # 4 MB on one line


@pytest.mark.parametrize("prompt", [HUGE, [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": HUGE}]],
                         ids=["text", "chat-messages"])
def test_multi_megabyte_prompt_is_refused_without_tokenizing_it(prompt):
    tokenizer = CountingTokenizer()
    rows = [{"prompt": "add 1 2", "answer": "3"}, {"prompt": prompt, "answer": "1"}]
    with pytest.raises(ConfigError) as error:
        PromptSet.from_rows(rows, "train.jsonl", tokenizer, 32, "error")
    size = len(HUGE) + (len("be brief") if isinstance(prompt, list) else 0)
    # the tiny tokenizer's longest token is '<|endoftext|>', 13 bytes
    assert str(error.value) == (
        f"train.jsonl: row 2: prompt is {size} bytes, more than data.max_prompt_tokens=32 "
        "tokens can hold (416 bytes: a token of this tokenizer covers at most 13 bytes); not "
        "tokenized (raise data.max_prompt_tokens, or set data.prompt_overflow=truncate)")
    assert tokenizer.seen == [7]  # only the short row was tokenized


def test_multi_megabyte_prompt_is_truncated_from_its_end_without_tokenizing_it():
    tokenizer = CountingTokenizer()
    rows = [{"prompt": HUGE + "1 2", "answer": "1"}]
    prompts = PromptSet.from_rows(rows, "train.jsonl", tokenizer, 32, "truncate")
    assert prompts.truncated == 1 and max(tokenizer.seen) <= 2 * 32 * 13
    (prompt,) = prompts.prompts
    assert len(prompt.prompt_ids) == 32
    assert tokenizer.inner.decode(list(prompt.prompt_ids)).endswith(
        "9 9 1 2<|im_end|>\n<|im_start|>assistant\n")
    # the same ids as tokenizing all of it would give
    short = HUGE[-2000:] + "1 2"
    full = PromptSet.from_rows([{"prompt": short, "answer": "1"}], "x", tokenizer.inner, 32,
                               "truncate")
    assert full.prompts[0].prompt_ids == prompt.prompt_ids


GOOD_LINE = b'{"prompt": "add 1 2", "answer": "3"}\n'


@pytest.mark.parametrize("data, row, at, what", [
    pytest.param(GOOD_LINE.decode().encode("utf-16"), 1, b"\xff\xfe",
                 "it is UTF-16 (it starts with a UTF-16 byte-order mark)", id="utf-16"),
    pytest.param(GOOD_LINE + b'{"prompt": "caf\xe9", "answer": "3"}\n', 2, b"\xe9",
                 "byte 0xe9 is not UTF-8", id="latin-1-row"),
    pytest.param(GOOD_LINE + b"\x89PNG\r\n\x1a\n\x00\x00", 2, b"\x89",
                 "byte 0x89 is not UTF-8", id="binary"),
    pytest.param(GOOD_LINE + b'{"prompt": "a\x00", "answer": "3"}\n', 2, b"\x00",
                 "a NUL byte (a binary file, or UTF-16)", id="nul-byte"),
    pytest.param(b"PAR1\x15\x04\x15\x00", 1, b"PAR1",
                 "it is a Parquet file (give it the suffix .parquet)", id="parquet-as-jsonl"),
])
def test_file_that_is_not_utf8_names_file_row_and_byte_offset(tmp_path, data, row, at, what):
    path = tmp_path / "train.jsonl"
    path.write_bytes(data)
    assert splits_error(tmp_path, path) == (
        f"data.train_path: {path}: row {row}: cannot be read as text at byte offset "
        f"{data.index(at)}: {what}; expected UTF-8 JSON lines (one object per line), or a "
        ".parquet file")


def test_utf8_byte_order_mark_is_read(tmp_path):
    from eddyrl.tasks.dataset import read_rows

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE.replace(b"\n", b"\r\n"))
    assert read_rows(path) == [{"prompt": "add 1 2", "answer": "3"}]


def test_the_first_bad_row_is_the_one_named_whichever_check_finds_it():
    """Rows are tokenized as one batch after the byte check, yet the error names the first bad
    row in file order: a too-many-tokens row 2 before a multi-megabyte row 3."""
    from eddyrl.models.tiny import build_tokenizer

    rows = [{"prompt": "add 1 2", "answer": "3"}, {"prompt": "add " + "9 " * 40, "answer": "1"},
            {"prompt": HUGE, "answer": "1"}]
    with pytest.raises(ConfigError, match=r"^train.jsonl: row 2: prompt is \d+ tokens"):
        PromptSet.from_rows(rows, "train.jsonl", build_tokenizer(), 32, "error")
    with pytest.raises(ConfigError, match=r"^train.jsonl: row 2: prompt is \d+ bytes"):
        PromptSet.from_rows([rows[0], rows[2], rows[1]], "train.jsonl", build_tokenizer(), 32,
                            "error")


def test_gsm8k_rows_read_as_plain_suggest_the_format(tmp_path):
    """Issue 34, item 7: a file with `question`/`answer` fields and data.format=plain was
    refused without suggesting gsm8k."""
    path = write_jsonl(tmp_path / "train.jsonl",
                       [{"question": "1 + 2?", "answer": "1 + 2 = 3\n#### 3"}])
    assert splits_error(tmp_path, path) == (
        f"data.train_path: {path}: row 1: missing field 'prompt' (fields there: 'question', "
        "'answer'); the row has the fields of format 'gsm8k': set data.format=gsm8k")

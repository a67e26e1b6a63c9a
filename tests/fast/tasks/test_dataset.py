"""JSONL loading fails early, naming the file and the 1-based row."""

import json

import pytest

from eddyrl.tasks.dataset import read_rows, write_rows


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"prompt": "add 1 2", "answer": "3"})


def test_good_rows_load_with_extra_fields(tmp_path):
    rows = [{"prompt": "add 1 2", "answer": "3", "num_terms": 2}]
    write_rows(tmp_path / "rows.jsonl", rows)
    assert read_rows(tmp_path / "rows.jsonl") == rows


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (json.dumps({"prompt": "add 1 2"}), "missing field 'answer'"),
        (json.dumps({"answer": "3"}), "missing field 'prompt'"),
        (json.dumps({"prompt": "add 1 2", "answer": 3}), "field 'answer' must be str, got int"),
        (json.dumps({"prompt": None, "answer": "3"}), "field 'prompt' must be str"),
        (json.dumps(["add 1 2", "3"]), "expected a JSON object"),
        ('{"prompt": "add 1 2", ', "not valid JSON"),
    ],
)
def test_bad_row_names_file_and_row(tmp_path, bad_line, message):
    path = _write_lines(tmp_path / "bad.jsonl", [GOOD, GOOD, bad_line])
    with pytest.raises(ValueError, match="row 3") as error:
        read_rows(path)
    assert str(path) in str(error.value)
    assert message in str(error.value)


def test_blank_lines_are_skipped_but_counted(tmp_path):
    path = _write_lines(tmp_path / "gaps.jsonl", [GOOD, "", json.dumps({"prompt": "x"})])
    with pytest.raises(ValueError, match="row 3"):
        read_rows(path)

"""Prompt datasets as JSONL: one `{"prompt": str, "answer": str, ...}` object per line.

Extra fields (such as `num_terms`) are kept as they are. Loading checks every row so that
a bad file fails at start-up with its name and line, not hours later inside a rollout.
"""

from __future__ import annotations

import json
from pathlib import Path

REQUIRED_FIELDS = {"prompt": str, "answer": str}


def write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict]:
    """Every row of `path`; raises ValueError naming the file and 1-based row on a bad row."""
    rows = []
    with open(path, encoding="utf-8") as file:
        for row_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            rows.append(_parse_row(line, path, row_number))
    return rows


def _parse_row(line: str, path: Path, row_number: int) -> dict:
    where = f"{path}: row {row_number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for field, expected_type in REQUIRED_FIELDS.items():
        if field not in row:
            raise ValueError(f"{where}: missing field {field!r}")
        if not isinstance(row[field], expected_type):
            raise ValueError(
                f"{where}: field {field!r} must be {expected_type.__name__}, "
                f"got {type(row[field]).__name__}"
            )
    return row

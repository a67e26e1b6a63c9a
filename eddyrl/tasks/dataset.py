"""Prompt datasets on disk: JSON lines (`.jsonl`, `.json`: one object per line) or Parquet
(`.parquet`, read with pyarrow), chosen by the file's suffix.

Each record becomes a `{"prompt", "answer", ...}` row through a row format (formats.py), and
extra fields (such as `num_terms`) are kept. Loading checks every row so that a bad file fails
at start-up naming the file, the 1-based row and the field, not hours later inside a rollout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from .formats import FORMATS, RowError, RowFormat, normalize

READERS_BY_SUFFIX = {".jsonl": "json lines", ".json": "json lines", ".parquet": "parquet"}
PARQUET_EXTRA = "eddyrl[data]"


def check_suffix(path: str | Path) -> None:
    """ValueError naming the path when its suffix is not one this module reads."""
    suffix = Path(path).suffix.lower()
    if suffix not in READERS_BY_SUFFIX:
        raise ValueError(f"data file '{path}' has suffix {suffix or '(none)'!r}; readable "
                         f"suffixes: {', '.join(READERS_BY_SUFFIX)} (JSON lines or Parquet)")


def write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")


def read_rows(path: str | Path, fmt: RowFormat = FORMATS["plain"]) -> list[dict]:
    """Every row of `path` in format `fmt`; ValueError naming the file (and the 1-based row and
    field for a bad row) when the file is missing, unreadable or holds a bad row."""
    path = Path(path)
    check_suffix(path)
    if not path.is_file():
        raise ValueError(f"data file '{path}' does not exist")
    rows = []
    for row_number, record in read_records(path):
        try:
            rows.append(normalize(record, fmt))
        except RowError as error:
            raise ValueError(f"{path}: row {row_number}: {error}") from None
    return rows


def read_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, raw record) for each row of a JSON lines or Parquet file."""
    if READERS_BY_SUFFIX[path.suffix.lower()] == "parquet":
        return _parquet_records(path)
    return _json_lines_records(path)


def _decode_line(path: Path, raw: bytes, row_number: int, offset: int) -> str:
    """A line of a JSON lines file as text; ValueError naming the file, the row and the byte
    offset when it is not UTF-8 text (a binary file, UTF-16, Latin-1, Parquet named .jsonl).
    A UTF-8 byte-order mark at the start of the file is dropped."""
    at, what = None, ""
    if row_number == 1 and raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        at, what = 0, "it is UTF-16 (it starts with a UTF-16 byte-order mark)"
    elif row_number == 1 and raw.startswith(b"PAR1"):
        at, what = 0, "it is a Parquet file (give it the suffix .parquet)"
    elif (nul := raw.find(b"\x00")) >= 0:  # valid UTF-8, but no text file holds one
        at, what = nul, "a NUL byte (a binary file, or UTF-16)"
    else:
        try:
            return raw.decode("utf-8-sig" if row_number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            at, what = error.start, f"byte 0x{raw[error.start]:02x} is not UTF-8"
    raise ValueError(f"{path}: row {row_number}: cannot be read as text at byte offset "
                     f"{offset + at}: {what}; expected UTF-8 JSON lines (one object per line), "
                     "or a .parquet file")


def _json_lines_records(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as file:
        offset = 0
        for row_number, raw in enumerate(file, start=1):
            line = _decode_line(path, raw, row_number, offset)
            offset += len(raw)
            if not line.strip():
                continue  # blank lines are skipped but counted, so row numbers are line numbers
            try:
                yield row_number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: row {row_number}: not valid JSON ({error.msg}); "
                                 "expected one JSON object per line") from None


def _parquet_records(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"data file '{path}' is Parquet, which needs pyarrow: "
                         f"pip install '{PARQUET_EXTRA}' (or pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's errors vary by version; the message is what matters
        raise ValueError(f"data file '{path}' is not a readable Parquet file "
                         f"({type(error).__name__}: {error})") from None
    row_number = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for record in batch.to_pylist():  # structs become dicts, lists of structs lists of dicts
            row_number += 1
            yield row_number, record

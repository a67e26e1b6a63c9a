"""`eddy report` on a run whose trace.json is empty, corrupt or not a trace: one line naming
the file and what is wrong (exit 2), and nothing written. Before (issue 32) each was a
traceback from json or from a missing key deep in the plotting."""

import json

import pytest

from eddyrl.cli import main
from eddyrl.observability.trace import Trace


def run_with_trace(run_dir, text: str | bytes):
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5,
                                                       "wall_s": 2.0}) + "\n")
    path = run_dir / "trace.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def refused(run_dir, capsys) -> str:
    assert main(["report", str(run_dir)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert not (run_dir / "report").exists()  # refused before anything is written
    return lines[0]


def test_report_on_an_empty_or_corrupt_trace(tmp_path, capsys):
    """Issue 32: `eddy report` crashed (a json traceback) on an empty or corrupt trace.json."""
    path = run_with_trace(tmp_path, "")
    assert f"{path} is empty (0 bytes)" in refused(tmp_path, capsys)
    path = run_with_trace(tmp_path, '{"traceEvents": [\n  {"ph": "X", "ts": 1,')
    assert f"{path} is not JSON: Expecting property name enclosed in double quotes at line " \
           "2, column 23; move it away to plot the metrics alone" in refused(tmp_path, capsys)


@pytest.mark.parametrize("data, problem", [
    pytest.param({"events": []}, "an object without 'traceEvents' (its keys: events)",
                 id="no-events"),
    pytest.param("a string", 'it holds str "a string", not a list of trace events',
                 id="a-string"),
    pytest.param({"traceEvents": 3}, "'traceEvents' is int, not a list", id="events-not-list"),
    pytest.param([1], "event 0 is int 1, not an object", id="event-not-object"),
    pytest.param([{"ph": "X", "name": "train", "pid": 2, "tid": 0, "ts": 1}],
                 "event 0 (ph 'X') has no 'dur'", id="span-without-dur"),
    pytest.param([{"ph": "X", "name": "train", "pid": 2, "tid": 0, "ts": "1", "dur": 1}],
                 "event 0 has 'ts' = \"1\", not a number", id="ts-a-string"),
    pytest.param([{"ph": "M", "name": "thread_name", "pid": 2, "tid": 0, "args": {}}],
                 "event 0 (thread_name) has no name in its 'args'", id="unnamed-thread"),
])
def test_report_on_a_json_file_that_is_not_a_trace(tmp_path, capsys, data, problem):
    path = run_with_trace(tmp_path, json.dumps(data))
    assert f"{path} is not a trace of `eddy train`: {problem}" in refused(tmp_path, capsys)


def test_a_trace_eddy_wrote_passes_the_check(tmp_path):
    from eddyrl.observability.report import load_trace

    trace = Trace()
    trace.name_thread("train", 0, "trainer rank 0")
    trace.span("train", 0, "train", 1.0, 0.5, {"busy_s": 0.5})
    trace.duration_s = 2.0
    trace.write(str(tmp_path / "trace.json"))
    loaded = load_trace(tmp_path / "trace.json")
    assert loaded.events == trace.events and loaded.threads == trace.threads

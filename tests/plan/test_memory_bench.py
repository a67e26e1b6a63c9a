"""bench/memory.py: the predicted table prints (fast), and one small row's real peak is within
15 % of the prediction (integration: a real FSDP engine step in a subprocess, a few seconds;
memory, not time, so a busy machine does not change it)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_every_rows_prediction(capsys):
    bench = _bench()
    assert bench.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = bench.default_rows()
    assert len(lines) == 1 + len(rows)
    for row, line in zip(rows, lines[1:]):
        assert line.startswith(row.name) and "dry run" in line
        assert float(line[len(row.name):].split()[0]) > 0  # GiB


def test_rows_over_the_budget_are_skipped_with_the_reason(capsys):
    bench = _bench()
    assert bench.main(["--rows", "8b L1", "--max-gib", "6"]) == 0
    out = capsys.readouterr().out
    assert "skipped: predicted over --max-gib 6" in out


def test_device_path_says_so_without_an_accelerator(capsys, monkeypatch):
    bench = _bench()
    import eddyrl.hal.registry as registry

    monkeypatch.setattr(registry, "detect", lambda: registry.get_platform("cpu"))
    assert bench.main(["--device", "--dry-run"]) == 0
    assert "no accelerator" in capsys.readouterr().out


@pytest.mark.integration  # a real engine step in a subprocess (via bench/memory.py)
def test_a_small_row_is_measured_within_15_percent(tmp_path):
    bench = _bench()
    row = bench.Row("small", 1, 256, chunk=128)
    plan = bench.predict(row, device=False)
    got = bench._run_child(row, str(tmp_path / "model"), device=False, glibc_default=False)
    assert "error" not in got, got
    assert abs(plan.peak - got["measured"]) <= 0.15 * got["measured"], (plan.peak, got)

"""bench/memory.py, predicted: the table prints a prediction for every row, rows over the
budget are skipped with the reason, and the device path says so without an accelerator. (One
small row measured against its prediction: test_memory_bench_measured.py.)"""

from memory_bench_script import memory_bench


def test_dry_run_prints_every_rows_prediction(capsys):
    bench = memory_bench()
    assert bench.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = bench.default_rows()
    assert len(lines) == 1 + len(rows)
    for row, line in zip(rows, lines[1:]):
        assert line.startswith(row.name) and "dry run" in line
        assert float(line[len(row.name):].split()[0]) > 0  # GiB


def test_rows_over_the_budget_are_skipped_with_the_reason(capsys):
    bench = memory_bench()
    assert bench.main(["--rows", "8b L1", "--max-gib", "6"]) == 0
    out = capsys.readouterr().out
    assert "skipped: predicted over --max-gib 6" in out


def test_device_path_says_so_without_an_accelerator(capsys, monkeypatch):
    bench = memory_bench()
    import eddyrl.hal.registry as registry

    monkeypatch.setattr(registry, "detect", lambda: registry.get_platform("cpu"))
    assert bench.main(["--device", "--dry-run"]) == 0
    assert "no accelerator" in capsys.readouterr().out

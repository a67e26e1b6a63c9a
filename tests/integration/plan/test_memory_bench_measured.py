"""bench/memory.py, measured: one small row's real peak is within 15 % of the prediction (a real
FSDP engine step in a subprocess, a few seconds; memory, not time, so a busy machine does not
change it). (The predicted table, no engine: test_memory_bench.py.)"""

import pytest
from memory_bench_script import memory_bench


@pytest.mark.integration  # a real engine step in a subprocess (via bench/memory.py)
def test_a_small_row_is_measured_within_15_percent(tmp_path):
    bench = memory_bench()
    row = bench.Row("small", 1, 256, chunk=128)
    plan = bench.predict(row, device=False)
    got = bench._run_child(row, str(tmp_path / "model"), device=False, glibc_default=False)
    assert "error" not in got, got
    assert abs(plan.peak - got["measured"]) <= 0.15 * got["measured"], (plan.peak, got)

"""`eddy report <run_dir>` on a run directory written by the test: the PNGs, the idle ratios,
and a clear error for a directory that holds no run."""

import json
from pathlib import Path

import pytest

from eddyrl.cli import main
from eddyrl.observability.report import load_metrics, run_seconds
from eddyrl.observability.trace import Trace


def write_run(run_dir, trace=True, counts=True):
    steps = [{"step": 0, "eval_accuracy": 0.2, "wall_s": 2.0}]
    for step in range(1, 6):
        steps.append({"step": step, "reward_mean": 0.1 * step, "staleness_max": step % 2,
                      "staleness_mean": 0.5 * (step % 2), "wall_s": 2.0 + 3 * step,
                      **({"staleness_counts": {"0": 8, "1": 8 * (step % 2)}} if counts
                         else {}),
                      **({"eval_accuracy": 0.2 + 0.1 * step} if step % 2 == 0 else {})})
    lines = [json.dumps(m) for m in steps]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 6, "rew')
    if trace:
        t = Trace()
        for role, index, name in (("train", 0, "trainer rank 0"),
                                  ("rollout", 0, "rollout worker 0"),
                                  ("rollout", 1, "rollout worker 1")):
            t.name_thread(role, index, name)
        for step in range(5):
            begin = 2.0 + 3 * step
            t.span("rollout", 0, "generate", begin, 2.0, {})
            t.span("rollout", 1, "generate", begin, 1.0, {})
            t.span("train", 0, "train", begin + 2.0, 0.5, {})
            for track in (("train", 0), ("rollout", 0), ("rollout", 1)):
                t.span(*track, "weight sync", begin + 2.5, 0.5, {})
            t.span("driver", 0, "reward", begin + 1.0, 0.1, {})
        t.duration_s = 22.0  # idle is counted from the first span, at 2 s: over 20 s
        t.write(str(run_dir / "trace.json"))


def test_report_writes_every_plot_and_the_idle_ratios(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("reward.png", "staleness.png", "idle.png", "timeline.png"):
        path = tmp_path / "report" / name
        assert path.stat().st_size > 5000, name
        assert str(path) in out
    result = json.loads((tmp_path / "report" / "report.json").read_text())
    # per step of 3 s on a 20 s run: worker 0 busy 2.5 s, worker 1 1.5 s, the trainer 1 s
    assert result["idle_ratio"]["rollout"] == pytest.approx(1 - 5 * 4.0 / (2 * 20.0))
    assert result["idle_ratio"]["train"] == pytest.approx(1 - 5 * 1.0 / 20.0)
    assert "rollout idle: 50.0%" in out and "train idle: 75.0%" in out
    assert result["steps"] == 5  # the line cut short by a crash is skipped


def test_report_without_a_trace_or_lag_counts(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_run(tmp_path, trace=False, counts=False)
    assert main(["report", str(tmp_path)]) == 0
    assert "no idle ratio or timeline" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png")) == \
        ["reward.png", "staleness.png"]


def test_report_refuses_a_directory_without_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert f"no run directory '{tmp_path / 'missing'}'" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert f"'{tmp_path}' has no metrics.jsonl: not a run directory of `eddy train`" in \
        capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_a_resumed_run_continues_the_time_axis(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in [
        {"step": 0, "wall_s": 1.0}, {"step": 1, "wall_s": 5.0},  # first run
        {"step": 2, "wall_s": 2.0}, {"step": 3, "wall_s": 4.0}]))  # resumed: clock from 0
    assert run_seconds(load_metrics(tmp_path)) == [1.0, 5.0, 7.0, 9.0]


def test_idle_ratio_from_a_simulator_trace_agrees_with_the_simulator(tmp_path):
    """The simulator writes the same trace format and counts idle time itself: `eddy report`'s
    reading of its trace gives the same rollout idle ratio."""
    from eddyrl.config import bundled
    from eddyrl.sim.config import load_scenario as load_config
    from eddyrl.observability.report import idle_by_role
    from eddyrl.sim.runtime import simulate

    scenario = bundled("sim/reflow_8")
    summary = simulate(load_config(scenario, ["loop.steps=4"]),
                       trace_path=str(tmp_path / "trace.json"))
    idle = idle_by_role(Trace.load(str(tmp_path / "trace.json")))
    assert idle["rollout"]["idle_ratio"] == pytest.approx(summary["rollout_idle"], abs=0.01)
    assert len(idle["rollout"]["workers"]) == summary["rollout_instances"]


def test_a_governed_run_gets_its_k_plot_and_moves(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_run(tmp_path, trace=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
            if line.endswith("}")]
    for row, (k, action) in zip(rows[1:], [(2, "hold"), (1, "lower"), (1, "hold"), (1, "hold"),
                                           (2, "raise")]):
        row.update(governor_k=k, governor_action=action, governor_reason=f"{action} reason")
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report" / "governor.png").stat().st_size > 5000
    result = json.loads((tmp_path / "report" / "report.json").read_text())
    assert result["governor"]["k"] == 2
    assert [(m["step"], m["action"]) for m in result["governor"]["moves"]] == \
        [(2, "lower"), (5, "raise")]

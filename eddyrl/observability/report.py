"""`eddy report <run_dir>`: PNG plots of a finished (or running) `eddy train` run from its
metrics.jsonl and trace.json, into <run_dir>/report/: reward and held-out accuracy against
time, accelerator idle ratio by role, the staleness histogram, the worker timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import EddyError
from .trace import Trace

ACCELERATOR_ROLES = ("rollout", "train")  # the driver's track is the controller's CPU


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's step metrics. A line cut short (a crash while writing) is skipped."""
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise EddyError(f"no run directory '{run_dir}'")
    if not path.is_file():
        raise EddyError(f"'{run_dir}' has no metrics.jsonl: not a run directory of "
                        "`eddy train` (its run_dir, e.g. runs/<date>-<time>)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not rows:
        raise EddyError(f"{path} holds no step yet")
    return rows


def run_seconds(rows: list[dict[str, Any]]) -> list[float]:
    """Each line's wall time since the run started. A resumed run starts its clock again:
    its steps are put after the steps before it."""
    times, offset, previous = [], 0.0, 0.0
    for row in rows:
        wall = float(row.get("wall_s", previous - offset))
        if wall + offset < previous:
            offset = previous
        previous = wall + offset
        times.append(previous)
    return times


def idle_by_role(trace: Trace) -> dict[str, dict[str, Any]]:
    """Per accelerator role: the idle share of its workers' time (1 - busy time / (workers x
    `seconds`), `seconds` from the first worker call to the run's end) and each worker's
    seconds per activity."""
    roles = {pid: role for role, pid in Trace.ROLES.items()}
    start, end = trace.window_s()
    seconds = max(end - start, 1e-9)
    busy = trace.busy_seconds()
    out: dict[str, dict[str, Any]] = {}
    for track in sorted(set(trace.threads) | set(busy)):
        role = roles.get(track[0])
        if role not in ACCELERATOR_ROLES:
            continue
        entry = out.setdefault(role, {"workers": {}, "idle_ratio": 0.0, "seconds": seconds})
        entry["workers"][trace.label(track)] = busy.get(track, {})
    for role, entry in out.items():
        total = sum(sum(kinds.values()) for kinds in entry["workers"].values())
        entry["idle_ratio"] = max(0.0, 1.0 - total / (seconds * len(entry["workers"])))
    return out


def report(run_dir: str | Path) -> dict[str, Any]:
    """Writes the plots; returns what it wrote and the idle ratios by role."""
    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise EddyError("eddy report draws with matplotlib: pip install 'eddyrl[plots]'") \
            from None
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    seconds = run_seconds(rows)
    unit, unit_s = ("minutes", 60.0) if seconds[-1] > 600 else ("seconds", 1.0)
    written = [_reward_plot(rows, seconds, unit, unit_s, out / "reward.png"),
               _staleness_plot(rows, out / "staleness.png")]
    result: dict[str, Any] = {"run_dir": str(run_dir), "steps": rows[-1].get("step", 0)}
    trace_path = run_dir / "trace.json"
    if trace_path.is_file():
        trace = Trace.load(str(trace_path))
        idle = idle_by_role(trace)
        if idle:
            written.append(_idle_plot(idle, out / "idle.png"))
        trace.plot(str(out / "timeline.png"), f"{run_dir.name}: worker activity (gaps: idle)",
                   xlabel=f"{unit} since the run started", unit_s=unit_s)
        written.append(out / "timeline.png")
        result["idle_ratio"] = {role: entry["idle_ratio"] for role, entry in idle.items()}
    else:
        result["no_trace"] = f"{trace_path} not found (observe.trace = false?): no idle " \
                             "ratio or timeline"
    result["written"] = [str(path) for path in written if path is not None]
    (out / "report.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result


def _reward_plot(rows, seconds, unit: str, unit_s: float, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    trained = [(t / unit_s, r["reward_mean"]) for t, r in zip(seconds, rows)
               if "reward_mean" in r]
    if trained:
        top.plot(*zip(*trained), marker=".", color="tab:blue")
    top.set_ylabel("training reward (mean)")
    held_out = [(t / unit_s, r["eval_accuracy"]) for t, r in zip(seconds, rows)
                if "eval_accuracy" in r]
    if held_out:
        bottom.plot(*zip(*held_out), marker="o", color="tab:green")
    bottom.set_ylabel("held-out accuracy")
    bottom.set_xlabel(f"{unit} since the run started")
    top.set_title("reward and held-out accuracy")
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    return _save(fig, path)


def _staleness_plot(rows, path: Path) -> Path:
    """Per-sample lags (trainer version - behaviour version) when the run logged them, else
    the per-step maximum."""
    import matplotlib.pyplot as plt

    counts: dict[int, int] = {}
    for row in rows:
        for lag, n in row.get("staleness_counts", {}).items():
            counts[int(lag)] = counts.get(int(lag), 0) + int(n)
    fig, axis = plt.subplots(figsize=(7, 4))
    if counts:
        axis.bar(list(counts), list(counts.values()), width=0.6, color="tab:purple")
        axis.set_ylabel("trained samples")
        axis.set_title("staleness of trained samples (versions behind the trainer)")
    else:
        per_step = [int(r["staleness_max"]) for r in rows if "staleness_max" in r]
        for lag in sorted(set(per_step)):
            counts[lag] = per_step.count(lag)
        axis.bar(list(counts), list(counts.values()), width=0.6, color="tab:purple")
        axis.set_ylabel("steps")
        axis.set_title("staleness: each step's maximum (versions behind the trainer)")
    axis.set_xlabel("staleness (versions)")
    axis.set_xticks(sorted(counts) or [0])
    return _save(fig, path)


def _idle_plot(idle: dict[str, dict[str, Any]], path: Path) -> Path:
    """One bar per worker: the share of the run in each activity, the rest idle."""
    import matplotlib.pyplot as plt

    labels, shares = [], []
    for entry in idle.values():
        for label, kinds in entry["workers"].items():
            labels.append(label)
            shares.append({k: v / entry["seconds"] for k, v in kinds.items()})
    fig, axis = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.8))
    left = [0.0] * len(labels)
    for kind in sorted({k for s in shares for k in s}):
        widths = [s.get(kind, 0.0) for s in shares]
        axis.barh(labels, widths, left=left, color=Trace.COLORS.get(kind, "tab:gray"),
                  label=kind)
        left = [a + b for a, b in zip(left, widths)]
    axis.barh(labels, [max(0.0, 1 - x) for x in left], left=left, color="lightgray",
              label="idle")
    axis.set_xlim(0, 1)
    seconds = next(iter(idle.values()))["seconds"]
    axis.set_xlabel(f"share of the {seconds:.0f} s from the first worker call to the end")
    axis.invert_yaxis()
    axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    axis.set_title("accelerator idle ratio: " + ", ".join(
        f"{role} {entry['idle_ratio']:.0%}" for role, entry in idle.items()))
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""`eddy report <run_dir>`: PNG plots of a finished (or running) `eddy train` run from its
metrics.jsonl and trace.json, into <run_dir>/report/: reward and held-out accuracy against
time, accelerator idle ratio by role, the staleness histogram, the worker timeline, and with
the stability governor on, its K over time (governor.png; each move and its reason in
report.json)."""

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


def load_trace(path: Path) -> Trace:
    """The run's trace.json; an EddyError naming the file and what is wrong with it (empty,
    not JSON at line and column, not a trace)."""
    move = "; move it away to plot the metrics alone"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EddyError(f"{path} cannot be read ({exc.strerror or exc}){move}") from None
    if not data.strip():
        raise EddyError(f"{path} is empty ({len(data)} bytes): the run wrote no trace into it "
                        f"(cut short while writing?){move}")
    try:
        parsed = json.loads(data)
    except UnicodeDecodeError as exc:
        raise EddyError(f"{path} is not a text JSON file (byte {exc.start} is not UTF-8)"
                        f"{move}") from None
    except json.JSONDecodeError as exc:
        raise EddyError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}, column "
                        f"{exc.colno}{move}") from None
    problem = trace_problem(parsed)
    if problem:
        raise EddyError(f"{path} is not a trace of `eddy train`: {problem}{move}")
    return Trace.from_json(parsed)


def trace_problem(data: Any) -> str | None:
    """What keeps parsed JSON from being a trace as `Trace.write` writes it (Chrome trace
    events: {"traceEvents": [...]} or the bare list), or None."""
    if isinstance(data, dict):
        if "traceEvents" not in data:
            return f"an object without 'traceEvents' (its keys: {', '.join(list(data)[:5])})"
        events = data["traceEvents"]
        other = data.get("otherData", {})
        if not isinstance(other, dict) or not _number_or_none(other.get("duration_s")):
            return f"'otherData' is {_shown(other)}, not {{\"duration_s\": <seconds>}}"
    elif isinstance(data, list):
        events = data
    else:
        return f"it holds {type(data).__name__} {_shown(data)}, not a list of trace events"
    if not isinstance(events, list):
        return f"'traceEvents' is {type(events).__name__}, not a list of events"
    for index, event in enumerate(events):
        problem = _event_problem(event)
        if problem:
            return f"event {index} {problem}"
    return None


def _event_problem(event: Any) -> str | None:
    if not isinstance(event, dict):
        return f"is {type(event).__name__} {_shown(event)}, not an object"
    phase, args = event.get("ph"), event.get("args", {})
    named = phase == "M" and event.get("name") in ("process_name", "thread_name")
    if phase != "X" and not named:
        return None  # a kind of event the report does not read: read past
    if not isinstance(args, dict):
        return f"has 'args' {_shown(args)}, not an object"
    needed = (("pid", "tid", "ts", "dur") if phase == "X" else
              ("pid", "tid") if event.get("name") == "thread_name" else ("pid",))
    for key in needed:
        if key not in event:
            return f"(ph {phase!r}) has no {key!r}"
        value = event[key]
        if isinstance(value, bool) or not isinstance(value, int if key in ("pid", "tid")
                                                     else (int, float)):
            return f"has {key!r} = {_shown(value)}, not a number"
    if phase == "X" and not isinstance(event.get("name"), str):
        return f"has 'name' = {_shown(event.get('name'))}, not a string"
    if phase == "X" and not _number_or_none(args.get("busy_s")):
        return f"has 'busy_s' = {_shown(args['busy_s'])}, not a number"
    if named and not isinstance(args.get("name"), str):
        return f"({event['name']}) has no name in its 'args'"
    return None


def _shown(value: Any) -> str:
    """`value` as JSON, cut to 40 characters: enough to recognise it on one line."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def report(run_dir: str | Path) -> dict[str, Any]:
    """Writes the plots; returns what it wrote and the idle ratios by role. A trace.json that
    cannot be read is refused before anything is written."""
    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    trace_path = run_dir / "trace.json"
    trace = load_trace(trace_path) if trace_path.is_file() else None
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise EddyError("eddy report draws with matplotlib: pip install 'eddyrl[observe]'") \
            from None
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    seconds = run_seconds(rows)
    unit, unit_s = ("minutes", 60.0) if seconds[-1] > 600 else ("seconds", 1.0)
    written = [_reward_plot(rows, seconds, unit, unit_s, out / "reward.png"),
               _staleness_plot(rows, out / "staleness.png")]
    result: dict[str, Any] = {"run_dir": str(run_dir), "steps": rows[-1].get("step", 0)}
    if any("governor_k" in row for row in rows):
        written.append(_governor_plot(rows, seconds, unit, unit_s, out / "governor.png"))
        result["governor"] = governor_moves(rows)
    if trace is not None:
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


def governor_moves(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The governor's last K and bounds' scale, and every step where it moved either, with its
    reason."""
    decided = [row for row in rows if "governor_k" in row]
    return {"k": decided[-1]["governor_k"],
            "correction_scale": decided[-1].get("governor_correction_scale", 1.0),
            "moves": [{"step": row.get("step"), "action": row.get("governor_action"),
                       "k": row["governor_k"], "reason": row.get("governor_reason"),
                       "correction_scale": row.get("governor_correction_scale", 1.0)}
                      for row in decided
                      if row.get("governor_action") in ("lower", "raise", "narrow", "widen")]}


def _governor_plot(rows, seconds, unit: str, unit_s: float, path: Path) -> Path:
    """K against time, a marker where the governor lowered or raised it."""
    import matplotlib.pyplot as plt

    points = [(t / unit_s, r["governor_k"], r.get("governor_action"))
              for t, r in zip(seconds, rows) if "governor_k" in r]
    fig, axis = plt.subplots(figsize=(9, 3.5))
    axis.step([t for t, _, _ in points], [k for _, k, _ in points], where="post",
              color="tab:orange")
    for action, label, marker, color in (("lower", "K lowered", "v", "tab:red"),
                                         ("raise", "K raised", "^", "tab:green")):
        moved = [(t, k) for t, k, a in points if a == action]
        if moved:
            axis.scatter(*zip(*moved), marker=marker, color=color, label=label, zorder=3)
    axis.set_ylabel("K (max staleness)")
    axis.set_xlabel(f"{unit} since the run started")
    axis.set_title("stability governor: K for the groups dispatched after each step")
    axis.yaxis.get_major_locator().set_params(integer=True)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize="small")
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

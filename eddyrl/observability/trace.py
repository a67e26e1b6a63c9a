"""What every worker did when, as a Perfetto / Chrome trace (open it at ui.perfetto.dev) and a
PNG timeline. One format for both runtimes: the simulator records its engines' busy intervals
in virtual seconds, a real run records its workers' calls (`tracing.TracingRuntime`) in wall
seconds since the run started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..run_dir import write_atomic


class Trace:
    """Busy intervals of every worker: one process per role, one thread per worker; gaps are
    idle time. Events are Chrome trace "complete" events (ph "X", microseconds)."""

    ROLES = {"rollout": 1, "train": 2, "driver": 3}  # driver: the controller's process

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.threads: dict[tuple[int, int], str] = {}  # (pid, tid) -> name shown in Perfetto
        self.duration_s: float | None = None  # the run's extent, when the recorder knows it

    def recorder(self, role: str, worker: int) -> Callable[[str, float, float, dict], None]:
        def record(name: str, start: float, seconds: float, args: dict) -> None:
            self.span(role, worker, name, start, seconds, args)
        return record

    def span(self, role: str, worker: int, name: str, start: float, seconds: float,
             args: dict) -> dict[str, Any]:
        """Adds one busy interval (seconds) and returns its event, which the caller may still
        lengthen (`dur`, microseconds)."""
        event = {"name": name, "ph": "X", "pid": self.ROLES[role], "tid": worker,
                 "ts": start * 1e6, "dur": seconds * 1e6, "args": args}
        self.events.append(event)
        return event

    def name_thread(self, role: str, worker: int, name: str) -> None:
        self.threads[(self.ROLES[role], worker)] = name

    # what each span is, for the timeline plot: generating, training, moving between roles
    KINDS = {"prefill": "generate", "decode": "generate", "train": "train",
             "weight sync": "weight sync", "replica": "lent to training",
             "join": "changing role", "leave": "changing role",
             "switch to train": "changing role", "switch to rollout": "changing role",
             "migrate": "migrate", "replace": "replace", "reward": "reward",
             "checkpoint": "checkpoint", "configure": "configure", "evaluate": "evaluate"}
    COLORS = {"generate": "tab:blue", "evaluate": "tab:gray", "train": "tab:green", "weight sync": "tab:orange",
              "lent to training": "tab:olive", "changing role": "tab:red",
              "migrate": "tab:purple", "replace": "black", "reward": "tab:cyan",
              "checkpoint": "tab:brown", "configure": "tab:pink"}

    def tracks(self) -> list[tuple[int, int]]:
        """(pid, tid) of every worker with a span, trainer above rollout in plots."""
        return sorted({(e["pid"], e["tid"]) for e in self.events}, reverse=True)

    def label(self, track: tuple[int, int]) -> str:
        roles = {pid: role for role, pid in self.ROLES.items()}
        return self.threads.get(track, f"{roles.get(track[0], track[0])} {track[1]}")

    def plot(self, path: str, title: str, xlabel: str = "simulated minutes",
             unit_s: float = 60.0) -> None:
        """A PNG of every worker's activity over time (the trainer on top, then each rollout
        instance), gaps being idle time; needs matplotlib (the `observe` extra)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tracks = self.tracks()
        rows = {track: i for i, track in enumerate(tracks)}
        spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for event in self.events:
            kind = self.KINDS.get(event["name"], event["name"])
            spans.setdefault((kind, rows[(event["pid"], event["tid"])]), []).append(
                (event["ts"] / 1e6 / unit_s, event["dur"] / 1e6 / unit_s))
        fig, axis = plt.subplots(figsize=(12, 0.3 * len(tracks) + 1.5))
        labelled = set()
        for (kind, row), bars in spans.items():
            axis.broken_barh(_merged(bars), (row - 0.4, 0.8),
                             color=self.COLORS.get(kind, "tab:gray"),
                             label=None if kind in labelled else kind)
            labelled.add(kind)
        axis.set_yticks(range(len(tracks)), [self.label(t) for t in tracks])
        axis.set_xlabel(xlabel)
        axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        axis.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def write(self, path: str) -> None:
        names = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": role}}
                 for role, pid in self.ROLES.items()]
        names += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                   "args": {"name": name}} for (pid, tid), name in sorted(self.threads.items())]
        extra = {} if self.duration_s is None else {"otherData": {"duration_s": self.duration_s}}
        # atomic and never through a link: a failed write (a full disk) keeps the last trace
        write_atomic(Path(path), json.dumps({"traceEvents": names + self.events,
                                             "displayTimeUnit": "ms", **extra}))

    @classmethod
    def load(cls, path: str) -> "Trace":
        """A trace `write` wrote (roles are matched by process name, so a trace from another
        writer that names its processes the same reads too)."""
        with open(path) as f:
            return cls.from_json(json.load(f))

    @classmethod
    def from_json(cls, data: Any) -> "Trace":
        """A trace from a trace file's parsed JSON (`report.trace_problem` says what is wrong
        with one that is not a trace)."""
        events = data["traceEvents"] if isinstance(data, dict) else data
        trace = cls()
        pids = {e["pid"]: e["args"]["name"] for e in events
                if e.get("ph") == "M" and e.get("name") == "process_name"}
        # renumber to this class's pids, so `label` and the roles below agree
        remap = {pid: cls.ROLES.get(name, pid) for pid, name in pids.items()}
        for event in events:
            if event.get("ph") == "X":
                trace.events.append({**event, "pid": remap.get(event["pid"], event["pid"])})
            elif event.get("ph") == "M" and event.get("name") == "thread_name":
                trace.threads[(remap.get(event["pid"], event["pid"]), event["tid"])] = \
                    event["args"]["name"]
        if isinstance(data, dict):
            trace.duration_s = data.get("otherData", {}).get("duration_s")
        return trace

    def busy_seconds(self) -> dict[tuple[int, int], dict[str, float]]:
        """Per worker track: seconds spent in each kind of activity. A span that stands for
        several calls counts the time they took (`busy_s`, see tracing.MERGE_GAP_S); other
        spans their length, overlaps within a kind once."""
        per: dict[tuple[int, int], dict[str, list[tuple[float, float]]]] = {}
        exact: dict[tuple[int, int], dict[str, float]] = {}
        for e in self.events:
            kind, track = self.KINDS.get(e["name"], e["name"]), (e["pid"], e["tid"])
            per.setdefault(track, {}).setdefault(kind, [])
            if "busy_s" in e.get("args", {}):
                exact.setdefault(track, {})[kind] = \
                    exact.get(track, {}).get(kind, 0.0) + e["args"]["busy_s"]
            else:
                per[track][kind].append((e["ts"] / 1e6, e["dur"] / 1e6))
        return {track: {kind: sum(w for _, w in _merged(bars, gap=0.0))
                        + exact.get(track, {}).get(kind, 0.0)
                        for kind, bars in kinds.items()} for track, kinds in per.items()}

    def window_s(self) -> tuple[float, float]:
        """From the first span (start-up before any worker call is not counted as idle) to
        the run's end as recorded, else the last span's end."""
        start = min((e["ts"] / 1e6 for e in self.events), default=0.0)
        end = self.duration_s if self.duration_s is not None else \
            max(((e["ts"] + e["dur"]) / 1e6 for e in self.events), default=0.0)
        return start, max(end, start)


def _merged(bars: list[tuple[float, float]], gap: float = 1e-3) -> list[tuple[float, float]]:
    """Back-to-back (start, width) spans joined, so a plot draws thousands of decode runs as a
    few bars."""
    merged: list[list[float]] = []
    for start, width in sorted(bars):
        if merged and start <= merged[-1][0] + merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], start + width - merged[-1][0])
        else:
            merged.append([start, width])
    return [(start, width) for start, width in merged]

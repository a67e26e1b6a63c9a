"""The simulator's record of what every worker did when: a Perfetto / Chrome trace and a PNG
timeline of worker activity and roles."""

from __future__ import annotations

from typing import Any, Callable


class Timeline:
    """Busy intervals of every simulated worker, written as a Chrome / Perfetto trace (open it
    at ui.perfetto.dev): one process per role, one thread per worker; gaps are idle time."""

    ROLES = {"rollout": 1, "train": 2}

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def recorder(self, role: str, worker: int) -> Callable[[str, float, float, dict], None]:
        def record(name: str, start: float, seconds: float, args: dict) -> None:
            self.events.append({"name": name, "ph": "X", "pid": self.ROLES[role],
                                "tid": worker, "ts": start * 1e6, "dur": seconds * 1e6,
                                "args": args})
        return record

    # what each span is, for the timeline plot: generating, training, moving between roles
    KINDS = {"prefill": "generate", "decode": "generate", "train": "train",
             "weight sync": "weight sync", "replica": "lent to training",
             "join": "changing role", "leave": "changing role",
             "switch to train": "changing role", "switch to rollout": "changing role"}
    COLORS = {"generate": "tab:blue", "train": "tab:green", "weight sync": "tab:orange",
              "lent to training": "tab:olive", "changing role": "tab:red"}

    def plot(self, path: str, title: str) -> None:
        """A PNG of every worker's activity over simulated time (the trainer on top, then each
        rollout instance), gaps being idle time; needs matplotlib (the `plots` extra)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tracks = sorted({(e["pid"], e["tid"]) for e in self.events}, reverse=True)
        rows = {track: i for i, track in enumerate(tracks)}
        spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for event in self.events:
            kind = self.KINDS.get(event["name"], event["name"])
            spans.setdefault((kind, rows[(event["pid"], event["tid"])]), []).append(
                (event["ts"] / 60e6, event["dur"] / 60e6))
        fig, axis = plt.subplots(figsize=(12, 0.3 * len(tracks) + 1.5))
        labelled = set()
        for (kind, row), bars in spans.items():
            axis.broken_barh(_merged(bars), (row - 0.4, 0.8),
                             color=self.COLORS.get(kind, "tab:gray"),
                             label=None if kind in labelled else kind)
            labelled.add(kind)
        roles = {pid: role for role, pid in self.ROLES.items()}
        axis.set_yticks(range(len(tracks)), [f"{roles[pid]} {tid}" for pid, tid in tracks])
        axis.set_xlabel("simulated minutes")
        axis.legend(loc="upper right", fontsize="small")
        axis.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def write(self, path: str) -> None:
        import json

        names = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": role}}
                 for role, pid in self.ROLES.items()]
        with open(path, "w") as f:
            json.dump({"traceEvents": names + self.events, "displayTimeUnit": "ms"}, f)


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

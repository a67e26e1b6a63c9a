"""Terminal output with rich: tables and progress. Kept apart so library code never prints."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

console = Console()
if not console.is_terminal:  # pipes and CI logs: do not squeeze tables into 80 columns
    console = Console(width=160)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes else "-"


def platforms_table(rows: list[dict], chosen: str) -> None:
    table = Table(title="Eddy platforms", title_justify="left")
    for column in ("platform", "available", "device type", "backend", "ray resource",
                   "visible devices env", "devices", "memory"):
        table.add_column(column)
    for row in rows:
        mark = " (auto)" if row["name"] == chosen else ""
        table.add_row(row["name"] + mark, "yes" if row["available"] else "no",
                      row["device_type"], row["backend"], row["ray_resource"],
                      row["visible_devices_env"], str(row["device_count"]),
                      _gib(row["memory_total"]))
    console.print(table)
    for row in rows:
        detail = row["device_name"] if row["available"] else f"unavailable: {row['reason']}"
        console.print(f"  {row['name']}: {detail}", highlight=False, markup=False,
                      soft_wrap=True)  # one line each, however long the reason


_STATUS_STYLE = {"passed": "green", "failed": "bold red", "skipped": "yellow"}


def platform_checks_table(platform: str, results: list, summaries: dict[str, str]) -> None:
    """`eddy platforms check`: one row per check (`CheckResult`s), then one line per failure
    with its message in full."""
    table = Table(title=f"Eddy platform checks: {platform}", title_justify="left")
    for column in ("check", "group", "result", "seconds"):
        table.add_column(column, no_wrap=True)  # names stay whole, for grep too
    for column in ("what it checks", "detail"):
        table.add_column(column, overflow="fold")
    for r in results:
        table.add_row(r.name, r.group, f"[{_STATUS_STYLE[r.status]}]{r.status}[/]",
                      f"{r.seconds:.1f}", summaries.get(r.name, ""),
                      Text(r.detail if r.status != "failed" else "see below"))
    console.print(table)
    counts = {status: sum(r.status == status for r in results) for status in _STATUS_STYLE}
    console.print(", ".join(f"{n} {status}" for status, n in counts.items()), highlight=False)
    for r in results:
        if r.status == "failed":
            console.print(f"FAILED {r.name}: {r.detail}", highlight=False, markup=False)


class TrainProgress:
    """A progress bar over RL steps: elapsed time and an ETA, reward, the last held-out accuracy
    with the step it was measured at, rollout tokens/s, the stability governor's K when on.
    `clock` is for tests (rich's own `get_time`). A resumed run's first update jumps to its
    step; rich's pace leaves out the first sample, so the ETA counts only the steps this
    process ran."""

    def __init__(self, steps: int, *, out: Console | None = None, clock=None) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.console = out or console
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"),
                                 TimeRemainingColumn(compact=True),
                                 TextColumn("{task.fields[status]}"),
                                 console=self.console, get_time=clock)
        self.task = self.progress.add_task("train", total=steps, status="starting")
        self.eval_accuracy: float | None = None
        self.eval_step: int | None = None

    def __enter__(self) -> "TrainProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, metrics: dict) -> None:
        step = metrics["step"]
        if "eval_accuracy" in metrics:
            self.eval_accuracy, self.eval_step = metrics["eval_accuracy"], step
        parts = [f"step {step}"]
        if "reward_mean" in metrics:
            parts.append(f"reward {metrics['reward_mean']:.3f}")
        if self.eval_accuracy is not None:
            parts.append(f"held-out acc {self.eval_accuracy:.3f} (step {self.eval_step})")
        if "tokens_per_s" in metrics:
            parts.append(f"{metrics['tokens_per_s']:.0f} tok/s")
        if "governor_k" in metrics:  # the stability governor's K, and its move this step
            moved = {"lower": " (lowered)", "raise": " (raised)", "narrow": " (bounds narrowed)",
                     "widen": " (bounds widened)"}
            parts.append(f"K {metrics['governor_k']}{moved.get(metrics['governor_action'], '')}")
            if metrics.get("governor_correction_scale", 1.0) != 1.0:
                parts.append(f"bounds x{metrics['governor_correction_scale']:.2g}")
        self.progress.update(self.task, completed=step, status=" | ".join(parts))
        if "eval_accuracy" in metrics:
            self.console.print(f"step {step}: held-out accuracy {metrics['eval_accuracy']:.3f}",
                               highlight=False)

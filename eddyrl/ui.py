"""Terminal output with rich: tables and progress. Kept apart so library code never prints."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

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
        console.print(f"  {row['name']}: {detail}", highlight=False, markup=False)

"""What the model writes, where a user can read it (`observe.samples`): at each held-out
evaluation, the first N held-out prompts with the response, the answer and the reward (and,
with several rewards, `data.rewards`, each one's value under `rewards`), in
`<run_dir>/samples.jsonl` (one line per sample, with its step) and, when they are on, as a
TensorBoard text and a W&B table. `eddy eval --show N` prints the same rows.

Before, nothing showed a run's outputs: a user loaded the checkpoint by hand to see them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from ..protocol import Group
from ..run_dir import open_append

SAMPLES = "samples.jsonl"  # in the run directory


def sample_rows(groups: Sequence[Group], decode: Callable[[list[int]], str], n: int
                ) -> list[dict[str, Any]]:
    """The first `n` groups' first responses as rows: prompt, response, answer, reward (the
    weighted sum), each named reward's own value (`rewards`) when there are several."""
    rows = []
    for group in list(groups)[:n]:
        if not group.trajectories:
            continue
        t = group.trajectories[0]
        rows.append({"prompt": group.prompt, "response": decode(t.result.token_ids),
                     "answer": group.answer, "reward": t.reward,
                     **({"rewards": dict(t.reward_parts)} if t.reward_parts else {}),
                     **({"reward_error": t.reward_error} if t.reward_error else {})})
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (TensorBoard renders text as Markdown)."""
    def cell(value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value)
        return text.replace("|", "\\|").replace("\n", " ")
    head = "| prompt | response | answer | reward |\n|---|---|---|---|\n"
    return head + "".join(f"| {cell(r['prompt'])} | {cell(r['response'])} | "
                          f"{cell(r['answer'])} | {reward_cell(r)} |\n" for r in rows)


def reward_cell(row: dict[str, Any]) -> str:
    """`0.7`, or with several rewards `0.7 (correct 0.5, format 1)`."""
    parts = row.get("rewards")
    shown = ", ".join(f"{name} {value:g}" for name, value in parts.items()) if parts else ""
    return f"{row['reward']:g}" + (f" ({shown})" if shown else "")


class SamplesFile:
    """`<run_dir>/samples.jsonl`, appended at each evaluation (never through a link)."""

    def __init__(self, path: Path) -> None:
        self.file = open_append(path)

    def samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        for row in rows:
            self.file.write(json.dumps({"step": step, **row}, sort_keys=True) + "\n")
        self.file.flush()

    def __call__(self, metrics: dict[str, Any]) -> None:
        """Metrics are not its to write."""

    def close(self) -> None:
        self.file.close()

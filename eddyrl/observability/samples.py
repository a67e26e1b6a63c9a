"""What the model writes, where a user can read it (`observe.samples`): at each held-out
evaluation, the first N held-out prompts with the response, the answer and the reward, in
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
    """The first `n` groups' first responses as rows: prompt, response, answer, reward."""
    rows = []
    for group in list(groups)[:n]:
        if not group.trajectories:
            continue
        t = group.trajectories[0]
        rows.append({"prompt": group.prompt, "response": decode(t.result.token_ids),
                     "answer": group.answer, "reward": t.reward,
                     **({"reward_error": t.reward_error} if t.reward_error else {})})
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (TensorBoard renders text as Markdown)."""
    def cell(value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value)
        return text.replace("|", "\\|").replace("\n", " ")
    head = "| prompt | response | answer | reward |\n|---|---|---|---|\n"
    return head + "".join(f"| {cell(r['prompt'])} | {cell(r['response'])} | "
                          f"{cell(r['answer'])} | {r['reward']:g} |\n" for r in rows)


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

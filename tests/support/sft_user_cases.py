"""Shared by the tests of `eddy sft` on the user's own data: rows of sums, written as JSONL, and
`run_sft_on_file` with the tests' settings (the CPU, a fixed seed, no log)."""

import json
import random
from pathlib import Path

import torch

from eddyrl.tasks.sft_data import SftFileConfig
from eddyrl.tasks.sft_user import run_sft_on_file

CPU = torch.device("cpu")


def sum_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"add {a} {b}", "response": f"{a} + {b} = {a + b}"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sft(model_dir, data, out, **settings) -> dict:
    kwargs = {"file": SftFileConfig(), "lr": 3e-3, "batch_size": 8, "seed": 0, "device": CPU,
              "log": lambda line: None, **settings}
    return run_sft_on_file(model_dir, str(data), out, **kwargs)

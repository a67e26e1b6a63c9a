"""Shared by the run directory fault tests: run checkpoints written as a run writes them (weights,
run state, then the manifest), one corrupted, the steps a folder holds, and a run's
metrics.jsonl."""

import asyncio
import json

import torch
from safetensors.torch import save_file

from eddyrl import checkpoints, resume
from eddyrl.core import run_state

CHECKPOINTS = resume.CHECKPOINTS


def state(step, seed=0, fingerprint="f", ledger=None):
    meta = {"format": run_state.FORMAT, "step": step, "seed": seed,
            "data": {"fingerprint": fingerprint}, "window": {}, "replay": {},
            "next_group_id": 0, "reward_errors": 0,
            "history": [{"step": s} for s in range(step + 1)], "rng": {}}
    return run_state.RunState(meta, ledger or {"step": step, "groups": {}},
                              {"rng.torch": torch.zeros(4, dtype=torch.uint8)})


def write(run_dir, step, *, ledger_text=None, **kwargs):
    """A run checkpoint of `step` as a run writes one: weights and run state, then the
    manifest. `ledger_text` replaces ledger.json *before* the manifest (so it verifies)."""
    async def fill(tmp):
        tmp.mkdir()
        save_file({"w": torch.full((64,), float(step))}, str(tmp / "model.safetensors"))
        run_state.write(tmp, state(step, **kwargs))
        if ledger_text is not None:
            (tmp / run_state.LEDGER_FILE).write_text(ledger_text)
    return asyncio.run(checkpoints.write(run_dir / CHECKPOINTS, step, fill))


def corrupt(path):
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))


def steps_in(root):
    return sorted(p.name for p in root.glob("step_*"))


def metrics(run_dir, steps):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n"
                                                   for s in steps))

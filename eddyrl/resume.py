"""`eddy train`'s run checkpoints and `resume=`.

A run checkpoint is the trainer's checkpoint (HF-format safetensors that plain transformers
loads, optimizer state and each rank's RNG: `engines/training/fsdp.py`) plus the controller's
state (`core/run_state.py`), in one directory written atomically with a manifest
(`checkpoints.py`): `<run_dir>/checkpoints/step_000042/`. One is written every
`checkpoint.every` steps and one at the end of the run; `<run_dir>/checkpoint/` mirrors the last
(hard links, no second copy), as it always held the final model.

`resume=auto` goes on from the newest checkpoint of `run_dir` that verifies, falling back past
partial or corrupt ones (each named in a warning); with none it starts fresh, and says so.
`resume=<path>` names a checkpoint (used as it is, or refused by name) or a directory holding
them. The metrics of steps after the checkpoint are dropped from `metrics.jsonl`: the resumed
run takes those steps again.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from . import checkpoints
from .core import run_state
from .errors import ConfigError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # under run_dir
FINAL = "checkpoint"  # under run_dir: the last checkpoint, mirrored

SaveTrainer = Callable[[str], Awaitable[None]]


@dataclass
class ResumePoint:
    path: Path
    state: run_state.RunState
    skipped: list[str] = field(default_factory=list)  # newer checkpoints passed over, and why

    @property
    def step(self) -> int:
        return self.state.step


def find(resume: str | None, run_dir: Path) -> ResumePoint | None:
    """Where a run with `resume` = `resume` starts: a checkpoint, or None for a fresh run."""
    if resume is None:
        return None
    if resume == "auto":
        root = Path(run_dir) / CHECKPOINTS
        path, skipped = checkpoints.latest(root)
        if path is None:
            log.warning(f"resume=auto: no complete checkpoint under '{root}'; starting a fresh "
                        "run (set run_dir to the run to resume)")
            return None
        return ResumePoint(path, run_state.read(path), skipped)
    target = Path(resume).resolve()
    if not target.exists():
        raise ConfigError(f"config key 'resume' = '{resume}': no such checkpoint or directory "
                          "(use resume=auto, or a path to a checkpoint or a run directory)")
    if (target / checkpoints.MANIFEST).exists() or checkpoints.step_of(target) is not None:
        checkpoints.verify(target)  # named by the user: used as it is, or refused by name
        return ResumePoint(target, run_state.read(target))
    root = target / CHECKPOINTS if (target / CHECKPOINTS).is_dir() else target
    path, skipped = checkpoints.latest(root)
    if path is None:
        raise ConfigError(f"config key 'resume' = '{resume}': no complete checkpoint under "
                          f"'{root}'" + "".join(f"; {reason}" for reason in skipped))
    return ResumePoint(path, run_state.read(path), skipped)


async def save(controller, save_trainer: SaveTrainer | None, run_dir: Path, step: int,
               keep_last: int) -> Path:
    """Write the run checkpoint of `step` and prune old ones; returns its path. The
    controller's state is taken before anything is awaited, so generation still running
    cannot change it; the trainer is idle between steps."""
    state = run_state.capture(controller)

    async def fill(tmp: Path) -> None:
        if save_trainer is not None:
            await save_trainer(str(tmp))  # creates `tmp` (its own staging, then a rename)
        run_state.write(tmp, state)

    root = Path(run_dir) / CHECKPOINTS
    path = await checkpoints.write(root, step, fill)
    checkpoints.prune(root, keep_last)
    return path


def every(config, controller, save_trainer: SaveTrainer | None, run_dir: Path
          ) -> Callable[[int], Awaitable[None]]:
    """The controller's between-steps hook: a checkpoint every `checkpoint.every` steps."""
    async def checkpoint(step: int) -> None:
        if config.every and step % config.every == 0:
            await save(controller, save_trainer, run_dir, step, config.keep_last)
    return checkpoint


async def save_final(controller, save_trainer: SaveTrainer | None, run_dir: Path,
                     keep_last: int, point: ResumePoint | None) -> Path:
    """The end-of-run checkpoint (unless a resume found nothing left to do: then the one it
    started from), mirrored at `<run_dir>/checkpoint`."""
    step = controller.history[-1]["step"]
    if point is not None and step == point.step:
        path = point.path
    else:
        path = await save(controller, save_trainer, run_dir, step, keep_last)
    checkpoints.mirror(path, Path(run_dir) / FINAL)
    return path


def restart_metrics(path: Path, point: ResumePoint) -> int:
    """`metrics.jsonl` as of the checkpoint: lines of later steps (the resumed run takes them
    again) and a line cut short by a crash are dropped; a run directory without the file gets
    the checkpoint's history. Returns the lines dropped."""
    path = Path(path)
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if _step_of_line(line) is not None
                and _step_of_line(line) <= point.step]
    else:
        lines, kept = [], [json.dumps(m, sort_keys=True) for m in point.state.meta["history"]]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    dropped = len(lines) - len(kept) if lines else 0
    if dropped:
        log.warning(f"{path}: dropped {dropped} line(s) of steps after the checkpoint's step "
                    f"{point.step}; the resumed run takes those steps again")
    return dropped


def summary(point: ResumePoint | None, requeued: list[str]) -> dict[str, Any]:
    """What the run's summary says about where it started."""
    if point is None:
        return {"resumed_from": None}
    return {"resumed_from": str(point.path), "resumed_step": point.step,
            "requeued_groups": len(requeued), "skipped_checkpoints": point.skipped}


def _step_of_line(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None

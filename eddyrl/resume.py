"""`eddy train`'s run checkpoints and `resume=`.

A run checkpoint is the trainer's checkpoint (HF-format safetensors that plain transformers
loads, or with `train.lora` peft's adapter files; optimizer state and each rank's RNG:
`engines/training/fsdp.py`) plus the controller's
state (`core/run_state.py`), in one directory written atomically with a manifest
(`checkpoints.py`): `<run_dir>/checkpoints/step_000042/`. One is written every
`checkpoint.every` steps and one at the end of the run; `<run_dir>/checkpoint/` mirrors the last
(hard links, no second copy), as it always held the final model.

`resume=auto` goes on from the newest checkpoint of `run_dir` that verifies, falling back past
partial or corrupt ones (each named in a warning); with none it starts fresh, and says so.
`resume=<path>` names a checkpoint (used as it is, or refused by name) or a directory holding
them. A checkpoint whose run state does not read (a malformed ledger under a valid manifest) is
passed over like a corrupt one.

Check first, then write: `find`, `check_settings` and `run_state.check_compatible` only read;
when all have passed, `begin` moves the branch the resume abandons (newer step directories,
good or corrupt, and their metrics lines) into `checkpoints/retired/`, named, never deleted,
and cuts `metrics.jsonl` back to the checkpoint's step: the resumed run takes those steps
again.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from . import checkpoints
from .core import run_state
from .errors import ConfigError, EddyError
from .run_dir import holds_run, write_atomic

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
    """Where a run with `resume` = `resume` starts: a checkpoint, or None for a fresh run.
    Reads only: nothing in `run_dir` changes here."""
    if resume is None:
        return None
    states: dict[Path, run_state.RunState] = {}

    def load(path: Path) -> run_state.RunState:  # a malformed run state is passed over too
        if path not in states:
            states[path] = run_state.read(path)
        return states[path]

    if resume == "auto":
        root = Path(run_dir) / CHECKPOINTS
        path, skipped = checkpoints.latest(root, load)
        if path is None:
            if holds_run(run_dir):
                raise ConfigError(
                    f"resume=auto: run_dir '{run_dir}' holds a run (metrics.jsonl) but none of "
                    f"its checkpoints under '{root}' can be used"
                    + "".join(f"; {reason}" for reason in skipped) + "; nothing was changed: "
                    "resume from a checkpoint by path (resume=<dir>), or choose another run_dir")
            log.warning(f"resume=auto: '{run_dir}' holds no run yet; starting a fresh run")
            return None
        return ResumePoint(path, load(path), skipped)
    target = Path(resume).resolve()
    if not target.exists():
        raise ConfigError(f"config key 'resume' = '{resume}': no such checkpoint or directory "
                          "(use resume=auto, or a path to a checkpoint or a run directory)")
    if (target / checkpoints.MANIFEST).exists() or checkpoints.step_of(target) is not None:
        checkpoints.verify(target)  # named by the user: used as it is, or refused by name
        return ResumePoint(target, load(target))
    root = target / CHECKPOINTS if (target / CHECKPOINTS).is_dir() else target
    path, skipped = checkpoints.latest(root, load)
    if path is None:
        raise ConfigError(f"config key 'resume' = '{resume}': no complete checkpoint under "
                          f"'{root}'" + "".join(f"; {reason}" for reason in skipped))
    return ResumePoint(path, load(path), skipped)


def already_holds_a_run(run_dir: Path) -> ConfigError:
    """The refusal of a fresh run in a directory that holds one, with advice that is true:
    `resume=auto` only where it would go on (a usable checkpoint), else why not and what
    instead (before: resume=auto was advised, and then refused for having no checkpoint)."""
    run_dir = Path(run_dir)
    logged = "metrics.jsonl" if (run_dir / "metrics.jsonl").is_file() else "no metrics.jsonl"
    steps = [p.name for p in checkpoints.step_dirs(run_dir / CHECKPOINTS)]
    what = f"{logged}, {len(steps)} checkpoint(s)" + (f", the newest {steps[-1]}" if steps
                                                        else "")
    quiet = logging.getLogger(checkpoints.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the reasons go into the message, not ahead of it
    try:
        path, skipped = checkpoints.latest(run_dir / CHECKPOINTS)
    finally:
        quiet.setLevel(level)
    if path is not None:
        how = f"go on with resume=auto (from {path.name}), choose another run_dir, or move it away"
    else:
        why = "".join(f"; {reason}" for reason in skipped)
        how = (f"none of its checkpoints can be resumed from{why}: choose another run_dir, or "
               "move that one away")
    return ConfigError(f"run_dir '{run_dir}' already holds a run ({what}); {how}")


def check_settings(point: ResumePoint | None, *, seed: int, steps: int) -> None:
    """What can be refused before the data is read: another seed, or nothing to train."""
    if point is None:
        return
    run_state.check_seed(point.state, seed)
    if steps < point.step:
        raise ConfigError(f"config key 'loop.steps' = {steps} is below the step of the "
                          f"checkpoint resumed from ({point.step}, '{point.path}'): there is "
                          f"nothing to train; set loop.steps above {point.step} to go on")


def begin(point: ResumePoint, run_dir: Path) -> Path | None:
    """Make `run_dir` go on from `point`, once every check has passed: the step directories
    newer than it (the branch a rollback or a fallback abandons, corrupt ones included), a
    final checkpoint of that branch and its metrics lines are moved into one folder
    `checkpoints/retired/<time>-after-step_N/` (named in a warning, nothing deleted), and
    `metrics.jsonl` is cut back to the checkpoint's step. Returns the folder, if any."""
    run_dir = Path(run_dir)
    retired = run_dir / CHECKPOINTS / checkpoints.RETIRED / (
        f"{datetime.datetime.now():%Y%m%d-%H%M%S}-after-step_{point.step:06d}")
    moved = checkpoints.retire_after(run_dir / CHECKPOINTS, point.step, retired)
    moved += _retire_other_branch(point, run_dir / CHECKPOINTS, retired)
    final = run_dir / FINAL
    final_step = _final_step(final)
    if final_step is not None and final_step > point.step:
        retired.mkdir(parents=True, exist_ok=True)
        os.rename(final, retired / FINAL)
        moved.append(retired / FINAL)
    restart_metrics(run_dir / "metrics.jsonl", point, retired)
    _cut_samples(run_dir / "samples.jsonl", point.step, retired)
    if not moved:
        if retired.is_dir():  # only metrics lines were dropped: they are in there
            log.warning(f"going on from '{point.path}': the metrics of later steps are kept "
                        f"in '{retired}'")
        return retired if retired.is_dir() else None
    log.warning(f"going on from '{point.path}' (step {point.step}): the newer checkpoints of "
                f"the branch it abandons ({', '.join(p.name for p in moved)}) and their metrics "
                f"were moved to '{retired}'")
    return retired


def _retire_other_branch(point: ResumePoint, root: Path, into: Path) -> list[Path]:
    """A resume from a checkpoint outside `root` (a retired one, another run's): the step
    directories in `root` up to its step whose history is not a beginning of its history
    belong to another branch; they are moved into `into` too, so that a later fallback can
    never go on from them. One whose run state does not read is left for `latest` to skip."""
    if point.path.parent.resolve() == root.resolve():
        return []  # in `root` already: the older ones are its own past (`begin` retires newer)
    history = point.state.meta["history"]
    moved = []
    for path in checkpoints.step_dirs(root):
        if checkpoints.step_of(path) > point.step:
            continue
        try:
            older = run_state.read(path).meta["history"]
        except (EddyError, OSError):
            continue
        if older != history[:len(older)]:
            into.mkdir(parents=True, exist_ok=True)
            os.rename(path, into / path.name)
            moved.append(into / path.name)
    return moved


def _final_step(final: Path) -> int | None:
    try:
        return int(json.loads((final / checkpoints.MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
    checkpoints.prune(root, keep_last)  # the newest keep_last that verify stay
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


def restart_metrics(path: Path, point: ResumePoint, keep_dropped: Path | None = None) -> int:
    """`metrics.jsonl` as of the checkpoint: one line per step of the checkpoint's own history.
    A line of a later step (the resumed run takes it again), a line cut short by a crash, and
    a line that disagrees with the checkpoint's history (another branch's step: a resume from
    a retired checkpoint) are dropped (into `keep_dropped/metrics.jsonl` when given), and a
    step the file lacks is written from the history. Returns the lines dropped."""
    path = Path(path)
    history = {m["step"]: m for m in point.state.meta["history"]
               if isinstance(m, dict) and isinstance(m.get("step"), int)
               and m["step"] <= point.step}
    found: dict[int, str] = {}
    dropped: list[str] = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                step = _step_of_line(line)
                if step in history and step not in found and _agrees(line, history[step]):
                    found[step] = line
                else:
                    dropped.append(line)
    kept = [found.get(step) or json.dumps(history[step], sort_keys=True)
            for step in sorted(history)]
    if dropped and keep_dropped is not None:
        keep_dropped.mkdir(parents=True, exist_ok=True)
        (keep_dropped / path.name).write_text("".join(line + "\n" for line in dropped))
    write_atomic(path, "".join(line + "\n" for line in kept))
    if dropped:
        log.warning(f"{path}: dropped {len(dropped)} line(s) that are not the checkpoint's "
                    f"history up to step {point.step}; the resumed run takes later steps again")
    return len(dropped)


def _cut_samples(path: Path, step: int, keep_dropped: Path) -> None:
    """`samples.jsonl` (observability/samples.py) as of the checkpoint: the samples of later
    steps go into `keep_dropped` (the resumed run writes those steps' again)."""
    if not path.is_file():
        return
    kept, dropped = [], []
    for line in path.read_text().splitlines():
        (kept if (_step_of_line(line) or 0) <= step else dropped).append(line)
    if dropped:
        keep_dropped.mkdir(parents=True, exist_ok=True)
        (keep_dropped / path.name).write_text("".join(line + "\n" for line in dropped))
        write_atomic(path, "".join(line + "\n" for line in kept))


def _agrees(line: str, logged: dict) -> bool:
    """A metrics line is the step `logged` recorded (the line adds only its wall_s)."""
    try:
        metrics = json.loads(line)
    except ValueError:
        return False
    metrics.pop("wall_s", None)
    return json.dumps(metrics, sort_keys=True) == json.dumps(logged, sort_keys=True)


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

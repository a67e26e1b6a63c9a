"""The run's checkpoints on disk: `<run_dir>/checkpoints/step_000042/`, each written whole or
not at all, checked before it is trusted, the newest few kept.

- Atomic: a checkpoint is written into a hidden temporary directory (`.step_000042.tmp`) and
  renamed into place; a rename is atomic, so a crash leaves either the whole checkpoint or a
  temporary directory that is never taken for one (and is removed by the next write).
- Checked: `manifest.json` is written last, with every file's size and sha256. A step directory
  without it, with a file missing, shorter or longer than listed, or with different contents is
  named (`CheckpointError`) and skipped in favour of the previous good one.
- Kept: after each write, the newest `keep_last` checkpoints that verify stay; older complete
  ones go. A corrupt one never counts, so it can never push the last good one out.
- Retired, not deleted: a run that goes on from an older checkpoint (a rollback, or a fallback
  past corrupt ones) moves the newer step directories aside (`retire_after`).

What goes inside is the caller's (see `resume.py`): this module knows files, not models.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from .errors import EddyError
from .validation import check_range

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RETIRED = "retired"  # under a checkpoints root: what a run moved aside, never deleted
FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d+)")
_CHUNK = 1 << 20


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 0  # steps between run checkpoints; 0: only at the end of the run
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted after a new write

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.every", self.every, 0)
        check_range(f"{prefix}.keep_last", self.keep_last, 1)


class CheckpointError(EddyError, RuntimeError):
    """A checkpoint is partial or corrupt; the message names it and what is wrong."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def step_of(path: Path) -> int | None:
    """The step of a `step_N` directory name; None for anything else."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


async def write(root: Path, step: int, fill: Callable[[Path], Awaitable[None]]) -> Path:
    """Write checkpoint `step` under `root`: `fill(tmp)` puts its files in the temporary
    directory `tmp` (it may create it itself: a trainer's save does), then the manifest is
    written and `tmp` renamed into place. On any failure the temporary directory is removed
    and the error goes on: no partial checkpoint is left where a resume would look."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        await fill(tmp)
        tmp.mkdir(exist_ok=True)
        _write_manifest(tmp, step)
        if final.exists():  # not this run's to delete (a resume retires newer steps first)
            _retire(final, root / RETIRED / f"{time.strftime('%Y%m%d-%H%M%S')}-replaced")
        os.rename(tmp, final)
        _remember_good(final)
    except BaseException:
        # with whatever `fill` staged beside it (a trainer's save stages into `<tmp>.tmp`):
        # a save that failed for a full disk must not leave a model's worth of files behind
        for partial in root.glob(f"{tmp.name}*"):
            shutil.rmtree(partial, ignore_errors=True)
        raise
    _fsync(root)
    return final


def verify(path: Path) -> dict:
    """The manifest of a complete checkpoint at `path`, every file checked against it; else a
    `CheckpointError` naming the checkpoint and the first thing wrong."""
    path = Path(path)
    where = f"checkpoint '{path}'"
    if not path.is_dir():
        raise CheckpointError(f"{where} does not exist")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{where} has no {MANIFEST}: its write did not finish") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{where}: {MANIFEST} is not a valid manifest") from None
    named = step_of(path)
    if named is not None and manifest.get("step") != named:  # a renamed or swapped directory
        step = manifest.get("step")
        back = f"; its name is '{step_dir(path.parent, step).name}'" \
            if isinstance(step, int) else ""
        raise CheckpointError(f"{where} is named for step {named} but its {MANIFEST} is of "
                              f"step {step} (renamed?){back}")
    for name, entry in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{where} is missing {name}")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{where}: {name} is {size} bytes, the manifest says "
                                  f"{entry['bytes']} (truncated or partly written)")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{where}: {name} does not match its sha256 in {MANIFEST} "
                                  "(corrupt)")
    _remember_good(path)
    return manifest


def latest(root: Path, load: Callable[[Path], object] | None = None
           ) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that verifies (and that `load`, when given, reads
    without a `CheckpointError`: a malformed file under a valid manifest), and why each newer
    one (and each unfinished write) was passed over; every such reason is also logged as a
    warning."""
    root = Path(root)
    skipped = [f"'{tmp}' is an unfinished write (a temporary directory); ignored"
               for tmp in sorted(root.glob(".step_*.tmp"))]
    found = None
    for path in sorted(step_dirs(root), key=step_of, reverse=True):
        try:
            verify(path)
            if load is not None:
                load(path)
        except CheckpointError as exc:
            skipped.append(f"{exc}; falling back to an earlier checkpoint")
            continue
        found = path
        break
    for reason in skipped:
        log.warning(reason)
    return found, skipped


def prune(root: Path, keep_last: int) -> list[Path]:
    """Keep the newest `keep_last` checkpoints that *verify*; delete the complete ones older
    than those, and stale temporary directories; returns what was deleted.

    Only a verified checkpoint counts towards `keep_last`: corrupt ones newer than the kept
    ones never push a good one out (they are left for a person to look at), so the checkpoint
    a run resumed from stays until a newer verified one exists. A checkpoint this process
    wrote or verified, whose manifest has not changed since, is not hashed again."""
    root = Path(root)
    kept: list[Path] = []
    doomed: list[Path] = []
    for path in sorted(step_dirs(root), key=step_of, reverse=True):
        if len(kept) >= keep_last:
            if (path / MANIFEST).is_file():
                doomed.append(path)
            continue
        try:
            if not _known_good(path):
                verify(path)
        except CheckpointError as exc:
            log.warning(f"{exc}; not counted as one of the {keep_last} kept")
            continue
        kept.append(path)
    doomed += sorted(root.glob(".step_*.tmp"))
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def retire_after(root: Path, step: int, into: Path) -> list[Path]:
    """Move every step directory under `root` newer than `step` (the branch a rollback or a
    fallback abandons, good or corrupt) into the folder `into`, keeping their names; returns
    where each went. Nothing is deleted: a person can look at them, or move one back."""
    root = Path(root)
    newer = sorted((p for p in step_dirs(root) if step_of(p) > step), key=step_of)
    moved = []
    for path in newer:
        into.mkdir(parents=True, exist_ok=True)
        target = into / path.name
        os.rename(path, target)
        moved.append(target)
    if moved:
        _fsync(root)
    return moved


def mirror(source: Path, target: Path) -> None:
    """`target` becomes a copy of `source`, replaced atomically. A copy, not hard links: a
    user who saves into `target` (`save_pretrained` truncates and rewrites a file in place)
    must not change the checkpoint it mirrors. The copy goes through the kernel
    (`copy_file_range`), which shares the blocks on file systems that can (XFS, btrfs)."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, copy_function=_copy)
    replace_dir(tmp, target)


def replace_dir(staging: Path, final: Path) -> None:
    """Put `staging` at `final`. A rename is atomic; replacing an existing directory needs
    two, so a crash in between leaves the previous contents at `final`.old, never a mix."""
    staging, final = Path(staging), Path(final)
    previous = final.with_name(final.name + ".old")
    shutil.rmtree(previous, ignore_errors=True)
    if final.exists():
        os.rename(final, previous)
    os.rename(staging, final)
    shutil.rmtree(previous, ignore_errors=True)


# Checkpoints this process wrote or verified, by path: each file's (name, inode, size, mtime)
# then. Pruning after every save would otherwise hash the kept checkpoints again each time; a
# file changed since (rewritten, truncated, replaced) changes its stamp and is hashed again.
_GOOD: dict[Path, tuple] = {}


def _manifest_stamp(path: Path) -> tuple:
    stamps = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = file.stat()
        stamps.append((file.relative_to(path).as_posix(), stat.st_ino, stat.st_size,
                       stat.st_mtime_ns))
    return tuple(stamps)


def _remember_good(path: Path) -> None:
    try:
        _GOOD[path.resolve()] = _manifest_stamp(path)
    except OSError:
        pass


def _known_good(path: Path) -> bool:
    try:
        return _GOOD.get(path.resolve()) == _manifest_stamp(path)
    except OSError:
        return False


def step_dirs(root: Path) -> list[Path]:
    """The `step_N` directories under `root`, oldest first (none when `root` is absent)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None),
                  key=step_of)


def _write_manifest(directory: Path, step: int) -> None:
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = file.relative_to(directory).as_posix()
        if name != MANIFEST:
            files[name] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # the manifest vouches for the rest: it must reach the disk
    _fsync(directory)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(directory: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable; not every OS allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _copy(source: str, target: str) -> None:
    with open(source, "rb") as src, open(target, "xb") as dst:
        size = os.fstat(src.fileno()).st_size
        try:
            copied = 0
            while copied < size:
                done = os.copy_file_range(src.fileno(), dst.fileno(), size - copied)
                if done == 0:
                    break
                copied += done
        except OSError:  # not supported across these file systems: a plain copy
            copied = 0
        if copied < size:
            src.seek(0)
            dst.seek(0)
            dst.truncate()
            shutil.copyfileobj(src, dst, _CHUNK)
    shutil.copystat(source, target)


def _retire(path: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    target = into / path.name
    os.rename(path, target)
    log.warning(f"'{path}' already existed; it was moved to '{target}', not deleted")
    return target

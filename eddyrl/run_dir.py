"""The run directory as one run's own: checked usable, locked for the run's lifetime, and
written only through here once every check has passed.

- Usable: a path that is a file, lies inside a file, is too long, or cannot be written (a
  read-only file system, no permission) is refused in one line naming the path and the cause,
  before anything starts.
- Locked: `<run_dir>/.eddy.lock` holds a POSIX record lock (`fcntl.lockf`) for as long as the
  run's process lives, so two runs on one directory cannot both run; the second is refused
  naming the first's PID. The kernel drops the lock with the process however it ends (SIGKILL
  included), and a record lock is not inherited by forked children (user-code workers), so a
  dead run never blocks the next. The file keeps the holder's PID while the lock is held and is
  emptied on a clean release: a PID found there with the lock free names a run that died
  (a stale lock), said in a warning, and the lock is taken over.
- Holds a run: `metrics.jsonl` with at least one step's line. An empty one (a run that failed
  while starting up) does not block a rerun.
- Staged writes: what a run generates before its checks are done (the built-in task's data)
  is written under `.staging/` and installed with one rename after them, so a refused run
  leaves the directory as it found it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger(__name__)

LOCK = ".eddy.lock"
METRICS = "metrics.jsonl"
STAGING = ".staging"
_HELD: set[Path] = set()  # run directories this process has claimed


class RunDirectory:
    """One run's hold on its directory: `claim` it, `release` it (or use it as a context
    manager); between the two, no other run can claim it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        _HELD.add(path.resolve())

    @classmethod
    def claim(cls, path: Path | str) -> RunDirectory:
        path = Path(path)
        _make(path)
        if path.resolve() in _HELD:  # record locks never conflict within one process
            raise ConfigError(f"run_dir '{path}' is in use by another run of this process; "
                              "choose another run_dir")
        lock = path / LOCK
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _unusable(path, exc) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise _unusable(path, exc) from None
            raise ConfigError(f"run_dir '{path}' is in use by another run "
                              f"({_describe(_holder(lock))}); wait for it to end, or choose "
                              "another run_dir") from None
        # read through `fd`: closing any other descriptor of the file would drop the lock
        stale = _parse_holder(os.pread(fd, 4096, 0))
        if stale:
            log.warning(f"run_dir '{path}': the run that held it ({_describe(stale)}) ended "
                        "without releasing it (killed?); taking it over")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "started": time.time()}).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Let the directory go; anything staged and not installed (a refused or failed
        start) goes with it."""
        if self._fd is None:
            return
        shutil.rmtree(self.path / STAGING, ignore_errors=True)
        try:  # emptied first: a holder's PID left in the file means it died holding it
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor drops the record lock
        self._fd = None
        _HELD.discard(self.path.resolve())

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- what is in it -------------------------------------------------------------------------
    def holds_run(self) -> bool:
        """A run has logged at least one step here."""
        return holds_run(self.path)

    def staging(self, name: str) -> Path:
        """An empty directory to write `name` into before the run's checks are done."""
        staged = self.path / STAGING / name
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        return staged

    def install(self, name: str) -> Path | None:
        """Put the staged `name` in place (replacing what was there) and drop the staging
        area; returns its final path (None: nothing was staged, nothing replaced)."""
        from .checkpoints import replace_dir

        staged, final = self.path / STAGING / name, self.path / name
        if staged.is_dir() and any(staged.iterdir()):
            replace_dir(staged, final)
        else:
            final = None
        shutil.rmtree(self.path / STAGING, ignore_errors=True)
        return final

    def clear_empty_metrics(self) -> None:
        """A fresh run starts its own metrics.jsonl: one left by a run that never logged a
        step (it failed while starting up) goes."""
        metrics = self.path / METRICS
        if metrics.exists() and not self.holds_run():
            log.info(f"{metrics}: no step was logged by the run that left it; starting anew")
            metrics.unlink()

    def write_text(self, name: str, text: str) -> Path:
        """`name` replaced atomically (a crash leaves the old file or the new one)."""
        final = self.path / name
        tmp = final.with_name(f".{final.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, final)
        return final


def holds_run(path: Path) -> bool:
    metrics = Path(path) / METRICS
    if not metrics.is_file():
        return False
    with open(metrics, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                if "step" in json.loads(line):
                    return True
            except (ValueError, TypeError):
                continue
    return False


def _make(path: Path) -> None:
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"run_dir '{path}' is a file, not a directory; choose a "
                              "directory")
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise ConfigError(f"run_dir '{path}' lies inside '{parent}', which is a "
                                      "file; choose a directory")
                break
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a name too long, no permission, a read-only file system
        raise _unusable(path, exc) from None


def _unusable(path: Path, exc: OSError) -> ConfigError:
    reason = exc.strerror or str(exc)
    hint = {errno.ENAMETOOLONG: "use a shorter path",
            errno.EROFS: "choose a directory on a writable file system",
            errno.EACCES: "choose a directory you can write to",
            errno.EPERM: "choose a directory you can write to",
            errno.ENOSPC: "free some space or choose another disk",
            errno.EDQUOT: "free some space or choose another disk"}.get(exc.errno,
                                                                        "choose another run_dir")
    return ConfigError(f"run_dir '{path}' cannot be used: {reason}; {hint}")


def _holder(lock: Path) -> dict | None:
    try:
        return _parse_holder(lock.read_bytes())
    except OSError:
        return None


def _parse_holder(data: bytes) -> dict | None:
    try:
        holder = json.loads(data or b"null")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "its PID is not recorded yet"
    started = holder.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) \
        if isinstance(started, (int, float)) else ""
    return f"pid {holder.get('pid')}{when}"

"""The run directory as one run's own: checked usable and Eddy's, locked for the run's
lifetime, and written only through here once every check has passed.

- Usable: a path that is a file, lies inside a file, is too long, or cannot be written (a
  read-only file system, no permission) is refused in one line naming the path and the cause,
  before anything starts.
- Eddy's: a directory that is not empty is used only if an Eddy run made it (it has Eddy's
  `.eddy.lock`, or a `metrics.jsonl` with a step from a run older than the lock file). Anything
  else (a project folder, a copy of some other tool's output) is refused naming what is in
  it: a run deletes and replaces what it writes (`data/`, `checkpoint/`, old checkpoints), so
  it must only ever find its own files there. Names Eddy does not write are never touched.
- No links: a symbolic link anywhere in the run directory is refused by name before anything
  is written (Eddy would otherwise write, truncate or delete through it, outside the
  directory), and the files Eddy writes are opened without following one (`O_NOFOLLOW`), so a
  link made after the check is refused too.
- Locked: the directory itself holds an exclusive `flock` for as long as the run's process
  lives, so two runs on one directory cannot both run; the second is refused naming the
  first's PID. The lock is on the directory, not on a name in it: deleting `.eddy.lock` during
  a run does not let a second run in. The kernel drops it with the process however it ends
  (SIGKILL included); a child forked from the run closes its inherited descriptor at once
  (`os.register_at_fork`), so it cannot keep the lock after the run ends. `.eddy.lock` keeps
  the holder's PID while the lock is held and is emptied on a clean release: a PID found there
  with the lock free names a run that died (a stale lock), said in a warning, and the lock is
  taken over.
- Holds a run: `metrics.jsonl` with at least one step's line, or a step checkpoint under
  `checkpoints/` (a copied run whose metrics were moved away still holds a run). An empty
  metrics file (a run that failed while starting up) does not block a rerun.
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
CHECKPOINTS = "checkpoints"
_HELD: set[Path] = set()  # run directories this process has claimed
_LOCKED_FDS: set[int] = set()  # descriptors holding a directory's flock, for `_after_fork`
_SHOWN = 5  # entries named in a refusal


def _after_fork() -> None:
    """In a forked child: close the inherited descriptors of the run directories' locks. A
    flock belongs to the open file description, which a fork shares: a child that outlived
    the run (a user-code worker) would otherwise keep the directory locked."""
    for fd in _LOCKED_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCKED_FDS.clear()
    _HELD.clear()


os.register_at_fork(after_in_child=_after_fork)


class RunDirectory:
    """One run's hold on its directory: `claim` it, `release` it (or use it as a context
    manager); between the two, no other run can claim it."""

    def __init__(self, path: Path, dir_fd: int, lock_fd: int, created: bool = False) -> None:
        self.path = path
        self._dir_fd: int | None = dir_fd
        self._fd: int | None = lock_fd
        self.created = created  # the claim made the directory: a run that wrote nothing removes it
        _HELD.add(path.resolve())

    @classmethod
    def claim(cls, path: Path | str) -> RunDirectory:
        path = Path(path)
        created = not os.path.lexists(path)  # (False for a name too long: _make says so)
        _make(path)
        if path.resolve() in _HELD:  # a process's own second claim: refused by name
            raise ConfigError(f"run_dir '{path}' is in use by another run of this process; "
                              "choose another run_dir")
        dir_fd = _lock_directory(path)
        try:
            check_owned(path)  # read-only: a refusal leaves no lock file behind
            lock_fd = _open_lock_file(path)
        except BaseException:
            _unlock(dir_fd)
            raise
        stale = _parse_holder(os.pread(lock_fd, 4096, 0))
        if stale:
            log.warning(f"run_dir '{path}': the run that held it ({_describe(stale)}) ended "
                        "without releasing it (killed?); taking it over")
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, json.dumps({"pid": os.getpid(), "started": time.time()}).encode(),
                  0)
        return cls(path, dir_fd, lock_fd, created)

    def release(self) -> None:
        """Let the directory go; anything staged and not installed (a refused or failed
        start) goes with it."""
        if self._fd is None:
            return
        staging = self.path / STAGING
        if staging.is_dir() and not staging.is_symlink():
            shutil.rmtree(staging, ignore_errors=True)
        try:  # emptied first: a holder's PID left in the file means it died holding it
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        # a start refused before it wrote anything leaves no empty run directory behind
        if self.created and [p.name for p in self.path.iterdir()] == [LOCK]:
            (self.path / LOCK).unlink()
            os.rmdir(self.path)
        _unlock(self._dir_fd)  # closing the directory's descriptor drops the lock
        self._dir_fd = None
        _HELD.discard(self.path.resolve())

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- what is in it -------------------------------------------------------------------------
    def holds_run(self) -> bool:
        """A run has logged a step or written a checkpoint here."""
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
        return write_atomic(self.path / name, text)


def write_atomic(final: Path, text: str | bytes) -> Path:
    """`final` replaced atomically by `text` through `.<name>.tmp`, neither followed if it is
    a symbolic link: a link at either name is refused by name (the rename would replace a
    link at `final` rather than write through it, but a link there was not Eddy's to drop)."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    for name in (final, tmp):
        if name.is_symlink():
            raise ConfigError(f"'{name}' is a symbolic link; Eddy does not write through "
                              "links in a run directory: remove it")
    try:  # left by a crash between the write and the rename: Eddy's own, a regular file
        tmp.unlink()
    except FileNotFoundError:
        pass
    data = text.encode() if isinstance(text, str) else text
    fd = open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)
    return final


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` that refuses a symbolic link at `path` by name (ELOOP) instead of writing
    through it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"'{path}' is a symbolic link; Eddy does not write through "
                              "links in a run directory: remove it") from None
        raise


def open_append(path: Path):
    """`path` opened to append text, created if absent, never through a link (the run's
    metrics, samples and worker errors)."""
    fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding="utf-8")


def holds_run(path: Path) -> bool:
    """A run has logged a step (metrics.jsonl) or written a step checkpoint here."""
    from .checkpoints import step_dirs

    return _logged_a_step(Path(path) / METRICS) or bool(step_dirs(Path(path) / CHECKPOINTS))


def check_owned(path: Path) -> None:
    """Refuse a run directory that is not empty and not an Eddy run's, or that holds a
    symbolic link, naming what is there; reads only."""
    path = Path(path)
    entries = sorted(p.name for p in path.iterdir())
    if entries and not (path / LOCK).exists() and not _logged_a_step(path / METRICS):
        shown = ", ".join(_entry(path / name) for name in entries[:_SHOWN])
        more = f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN else ""
        raise ConfigError(
            f"run_dir '{path}' is not empty and is not an Eddy run directory (it has no "
            f"{LOCK}): it holds {shown}{more}. A run replaces and deletes what it writes there"
            " (data/, checkpoint/, checkpoints/): choose a new or empty directory")
    links = _links(path)
    if links:
        shown = ", ".join(f"'{link.relative_to(path)}' -> '{os.readlink(link)}'"
                          for link in links[:_SHOWN])
        more = f" and {len(links) - _SHOWN} more" if len(links) > _SHOWN else ""
        raise ConfigError(
            f"run_dir '{path}' holds symbolic links: {shown}{more}. Eddy does not write, "
            "truncate or delete through links in a run directory: remove them (to put a run "
            "on another disk, point run_dir there)")


def _entry(path: Path) -> str:
    return f"'{path.name}/'" if path.is_dir() and not path.is_symlink() else f"'{path.name}'"


# Folders other programs keep in a run directory, with links of their own that Eddy never
# writes through (W&B's `latest-run`): looked at, not into.
_NOT_EDDYS = ("wandb",)


def _links(path: Path) -> list[Path]:
    """The symbolic links under `path`, none followed (nor looked for inside `_NOT_EDDYS`)."""
    found = []
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in sorted(dirs + files):
            entry = Path(root) / name
            if entry.is_symlink():
                found.append(entry)
        if Path(root) == path:
            dirs[:] = [d for d in dirs if d not in _NOT_EDDYS]
    return found


def _logged_a_step(metrics: Path) -> bool:
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


def _lock_directory(path: Path) -> int:
    """An exclusive flock on the directory itself (held through the returned descriptor); a
    second holder is refused naming the first from `.eddy.lock`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _unusable(path, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _unusable(path, exc) from None
        raise ConfigError(f"run_dir '{path}' is in use by another run "
                          f"({_describe(_holder(path / LOCK))}); wait for it to end, or "
                          "choose another run_dir") from None
    _LOCKED_FDS.add(fd)
    return fd


def _unlock(fd: int | None) -> None:
    if fd is None:
        return
    _LOCKED_FDS.discard(fd)
    os.close(fd)


def _open_lock_file(path: Path) -> int:
    try:
        return open_no_follow(path / LOCK, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise _unusable(path, exc) from None


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
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _parse_holder(os.read(fd, 4096))
    finally:
        os.close(fd)


def _parse_holder(data: bytes) -> dict | None:
    try:
        holder = json.loads(data or b"null")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "its PID is not recorded"
    started = holder.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) \
        if isinstance(started, (int, float)) else ""
    return f"pid {holder.get('pid')}{when}"

"""Process-wide state that user code in thread mode shares with the trainer, watched around
each call and put back when a call changed it.

A reward function that calls `torch.set_default_dtype(torch.float64)` changed the trainer's
numbers; one that calls `os.umask(0o777)` made every checkpoint file mode 000. What is cheap
to read and to set back is kept here (ASPECTS): the current directory, the umask, sys.stdout
and sys.stderr, and (once torch is loaded) torch's default dtype, intra-op thread count,
float32 matmul precision and deterministic-algorithms setting. Each change is set back when
the call ends and named in one warning per function and aspect.

The baseline is the state before the first of the calls running at once, not each call's own
start: a call that starts while another has changed something must not take that change for
the trainer's (while a call abandoned past its limit is stuck, the baseline stays the one from
before it). Not watched: environment variables (Eddy's own workers set some while a run goes
on, which a restore would undo). What cannot be put back: a change is seen by the trainer
while the call runs; memory, environment variables, other module globals (random seeds,
logging, warnings filters), open files, threads and rlimits are shared outright. Process mode
(`user_code.*.mode: process`) isolates them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

from ..process_umask import current_umask

log = logging.getLogger(__name__)


class Aspect(NamedTuple):
    what: str  # as the warning names it
    read: Callable[[], Any]
    write: Callable[[Any], Any]
    swap: bool = False  # `write` returns the value it replaced: restore blind, compare after


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # deleted under the process
        return None


def _chdir(path: str | None) -> None:
    if path is not None:
        os.chdir(path)


def _set_stream(name: str) -> Callable[[Any], None]:
    return lambda stream: setattr(sys, name, stream)


def _torch_aspects(torch: Any) -> list[Aspect]:
    def deterministic() -> tuple[bool, bool]:
        return (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())

    return [
        Aspect("torch's default dtype", torch.get_default_dtype, torch.set_default_dtype),
        Aspect("torch's thread count", torch.get_num_threads, torch.set_num_threads),
        Aspect("torch's float32 matmul precision", torch.get_float32_matmul_precision,
               torch.set_float32_matmul_precision),
        Aspect("torch's deterministic algorithms", deterministic,
               lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
    ]


ASPECTS = [
    Aspect("the current directory", _cwd, _chdir),
    Aspect("the umask", current_umask, os.umask, swap=True),  # reading it costs more than setting
    Aspect("sys.stdout", lambda: sys.stdout, _set_stream("stdout")),
    Aspect("sys.stderr", lambda: sys.stderr, _set_stream("stderr")),
]


_WITH_TORCH: list[Aspect] = []


def aspects() -> list[Aspect]:
    """What is watched now: torch's part only once torch is loaded (never loaded for this)."""
    if not _WITH_TORCH:
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "use_deterministic_algorithms"):
            return ASPECTS
        _WITH_TORCH.extend(ASPECTS + _torch_aspects(torch))
    return _WITH_TORCH


def _snapshot() -> dict[str, tuple[Aspect, Any]]:
    taken = {}
    for aspect in aspects():
        try:
            taken[aspect.what] = (aspect, aspect.read())
        except Exception:  # noqa: BLE001 (torch half-imported by another thread: not yet)
            pass
    return taken


def _shown(what: str, value: Any) -> str:
    if what == "the umask":
        return f"{value:04o}"
    return repr(value)


class ProcessStateGuard:
    """Counts the user-code calls running at once; keeps the state from before the first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._baseline: dict[str, tuple[Aspect, Any]] = {}
        self._warned: set[tuple[str, str]] = set()

    @contextmanager
    def around(self, fn: Callable, pool: str) -> Iterator[None]:
        with self._lock:
            if self._running == 0:
                self._baseline = _snapshot()
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                changed = self._restore()
            for what, before, after in changed:
                self._warn(fn, pool, what, before, after)

    def _restore(self) -> list[tuple[str, Any, Any]]:
        """Put back what differs from the baseline (lock held); what it was and became."""
        changed = []
        for what, (aspect, before) in self._baseline.items():
            try:
                if aspect.swap:  # set to what it was: whatever it held is what the code left
                    after = aspect.write(before)
                else:
                    after = aspect.read()
                    if after != before:
                        aspect.write(before)
                if after != before:
                    changed.append((what, before, after))
            except Exception as exc:  # noqa: BLE001 (a setting torch refuses back: say so)
                log.warning("could not restore %s after user code changed it: %s", what, exc)
        return changed

    def _warn(self, fn: Callable, pool: str, what: str, before: Any, after: Any) -> None:
        name = _name_of(fn)
        if (name, what) in self._warned:
            return
        self._warned.add((name, what))
        log.warning("%s code %s changed %s (%s -> %s) while it ran; restored. User code in "
                    "thread mode shares the trainer's process: use process mode "
                    "(user_code.*.mode: process) to isolate it", pool, name, what,
                    _shown(what, before), _shown(what, after))


def _name_of(fn: Callable) -> str:
    fn = getattr(fn, "func", fn)  # a functools.partial
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__name__)}"


GUARD = ProcessStateGuard()  # one per process: every thread pool's calls share its state

"""Where user code runs: a reward function or an environment, code the run did not write and
cannot trust to return, to return on time, or to return the right thing.

Three modes, one interface (`await pool.call(fn, *args, timeout_s=)`, `pool.session()`):

- `inline`: `fn` is called directly on the caller's event loop, as it always was. Nothing can
  interrupt synchronous code (a coroutine is cut off at `timeout_s`); the simulator, whose
  virtual clock must stay deterministic, and scripted tests use it.
- `thread`: on worker threads, at most `workers` of them, started when there is work. The
  event loop goes on while user code runs, and keeps the time: a call running past
  `timeout_s` is answered "timeout" at once and its thread is abandoned. A Python thread cannot
  be killed, so a `UserCodeTimeout` is raised into it, which stops pure-Python code at its next
  bytecode but not a blocking system call (`time.sleep`) or C code; the thread ends when that
  returns (daemon threads: none holds the interpreter's exit). A fresh thread takes its place.
- `process`: in worker processes (`python -m eddyrl.usercode.child`), each its own session, so
  a terminal's Ctrl-C reaches the controller only. A call past `timeout_s` gets its process
  killed (its process group: what the code started too); a process that dies (a segfault,
  `os._exit`, the OOM killer) loses the calls it held. Either way a fresh process takes its
  place. What crosses over (`fn`, its arguments and result, the pool's `shared` object) must
  pickle; `shared` is sent once per process.

Failures of user code are `UserCodeError`s, never raised further: `reason` "error" (it raised
anything but KeyboardInterrupt, SystemExit included; `message` is "Type: text"), "timeout"
(`message` says what became of its worker) or "lost" (its worker died or was killed, or the
pool is closed). A KeyboardInterrupt raised by user code is raised in the caller, as a Ctrl-C
would be: it stops the run. A `fork()` in user code: the forked copy leaves (`os._exit(0)`) as
soon as it returns into the pool's code, so only the original answers.

The shared parts (errors, `Pool`, jobs, the inline mode) are here; the thread pool is in
`threads.py`, the process pool in `processes.py` (its child's side in `child.py`), the pool
of a mode by name in `factory.py`.

Sessions hold state across calls (an environment lives across an episode's turns):
`session.call(fn, *args)` runs `fn(state, *args)` (a coroutine function is awaited) with the
same `SessionState` every time, one call at a time. Inline, on the caller's loop; in a thread
pool, on the session's own event loop, run by whichever worker thread takes the call (a
session whose call timed out is lost: its loop is stuck in the abandoned thread); in a process
pool, in one worker process, on that process's event loop, shared with the other sessions there
(a session whose process is killed or dies is lost).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

REASONS = ("error", "timeout", "lost")
CLOSED = "the user-code pool is closed"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds `eddyrl`
MAX_FAILED_STARTS = 3  # worker processes that die before they are ready, in a row


class UserCodeError(Exception):
    """User code failed; it costs the call, not the run. `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


class UserCodeTimeout(BaseException):
    """Raised into a worker thread whose call ran past its limit. A BaseException, so that
    user code's `except Exception` does not swallow it."""


class SessionState:
    """What a session's calls share: the pool's `shared` object, and whatever they set."""

    def __init__(self, shared: Any) -> None:
        self.shared = shared


def describe(exc: BaseException) -> str:
    if isinstance(exc, _Exited):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _own_cancellation() -> bool:
    """Whether the running task is being cancelled (a CancelledError user code raises on its
    own is its failure; one that cancels the caller must go on)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Pool:
    """Runs user code in one of the modes (`factory.make_pool`); see the module's docstring."""

    mode = ""
    timeout_note = ""  # what a call past its limit costs its worker, for the log

    def __init__(self, workers: int = 1, *, name: str = "user code", shared: Any = None) -> None:
        if workers < 1:
            raise ValueError(f"a user-code pool needs at least one worker, not {workers}")
        self.workers, self.name, self.shared = workers, name, shared
        self.closed = False
        self.replaced = 0  # workers replaced after a call ran past its limit, or a death
        self.timeouts = 0

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Any:
        """`fn(*args)`'s result; UserCodeError if it fails (see the module's docstring)."""
        raise NotImplementedError

    def session(self) -> Any:
        """A new session: state kept across its calls (`call(fn, *args)`, `close()`)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop every worker; calls still waiting are "lost". Idempotent."""
        self.closed = True

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------ inline

async def _inline(fn: Callable, args: tuple, timeout_s: float | None) -> Any:
    pid, limit = os.getpid(), None
    try:
        result = fn(*args)
        if inspect.isawaitable(result):
            async with asyncio.timeout(timeout_s) as limit:
                result = await result
        return result
    except KeyboardInterrupt:
        raise
    except asyncio.CancelledError as exc:
        if _own_cancellation():
            raise
        raise UserCodeError("error", describe(exc)) from None
    except BaseException as exc:  # SystemExit included: it ends the call, not the run
        if limit is not None and limit.expired():
            raise UserCodeError("timeout", "it was cancelled") from None
        raise UserCodeError("error", describe(exc)) from None
    finally:
        if os.getpid() != pid:  # a fork's copy, back in the pool's hands: it ends here
            os._exit(0)


class InlinePool(Pool):
    mode = "inline"
    timeout_note = "it was cancelled"

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Any:
        return await _inline(fn, args, timeout_s)

    def session(self) -> "InlineSession":
        return InlineSession(self)


class InlineSession:
    def __init__(self, pool: InlinePool) -> None:
        self.state: SessionState | None = SessionState(pool.shared)

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Any:
        if self.state is None:
            raise UserCodeError("lost", "the session is closed")
        return await _inline(fn, (self.state, *args), timeout_s)

    async def close(self, timeout_s: float | None = None) -> None:
        self.state = None


# ------------------------------------------------------------------ thread and process pools

class Job:
    """One call: queued, running on a worker, then finished (or abandoned past its limit, or
    cancelled before it started). `started` and `done` are futures of the caller's loop; `done`
    holds an outcome: ("ok", value), ("error", UserCodeError), ("interrupt", None) or
    ("cancelled", None)."""

    __slots__ = ("run", "payload", "id", "loop", "started", "done", "state", "lock", "worker")

    def __init__(self, loop: asyncio.AbstractEventLoop, run: Callable | None = None,
                 payload: bytes | None = None, job_id: int = 0) -> None:
        self.run, self.payload, self.id, self.loop = run, payload, job_id, loop
        self.started = loop.create_future()
        self.done = loop.create_future()
        self.state = "queued"  # queued | running | finished | abandoned | cancelled
        self.lock = threading.Lock()
        self.worker: Any = None


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def post(job: Job, future: asyncio.Future, value: Any) -> None:
    """Resolve one of `job`'s futures from any thread."""
    try:
        job.loop.call_soon_threadsafe(_resolve, future, value)
    except RuntimeError:  # its loop is closed: nobody waits any more
        pass


class WorkerPool(Pool):
    """What the thread and process pools share: a call waits for its job to start, then for
    it to finish within `timeout_s`, past which the worker is given up (`_give_up`)."""

    async def _outcome(self, job: Job, timeout_s: float | None) -> Any:
        # The limit is kept by a task of its own, so that it holds for a caller that is
        # cancelled while its call runs (the worker would otherwise be stuck for good).
        watch = asyncio.ensure_future(self._watch(job, timeout_s))
        try:
            kind, value = await asyncio.shield(watch)
        except asyncio.CancelledError:
            self._cancel(job)
            raise
        if kind == "ok":
            return value
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "cancelled":
            raise asyncio.CancelledError
        raise value

    async def _watch(self, job: Job, timeout_s: float | None) -> tuple[str, Any]:
        await job.started
        if timeout_s is not None and not job.done.done():
            await asyncio.wait((job.done,), timeout=timeout_s)
            if not job.done.done() and self._give_up(job):
                self.timeouts += 1
                return "error", UserCodeError("timeout", self.timeout_note)
        return await job.done

    def _cancel(self, job: Job) -> None:
        """The caller is gone: a job not started yet never runs; a running one runs on (its
        result is dropped), still bounded by its limit."""
        with job.lock:
            if job.state != "queued":
                return
            job.state = "cancelled"
        _resolve(job.started, None)
        _resolve(job.done, ("cancelled", None))

    def _give_up(self, job: Job) -> bool:
        """`job` ran past its limit: stop waiting for its worker (False: it just finished)."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------ thread

class _Exited(Exception):
    """User code raised SystemExit inside an event loop's task, carried out of it as an
    ordinary exception (a SystemExit escaping a task ends that loop's run); `describe` gives
    the SystemExit's own description."""


async def invoke(fn: Callable, args: tuple) -> Any:
    try:
        result = fn(*args)
        return (await result) if inspect.isawaitable(result) else result
    except SystemExit as exc:
        raise _Exited(describe(exc)) from None


def lose_queued(jobs) -> None:
    """A closing pool's jobs that never started: each answered lost (closed), once."""
    for job in jobs:
        with job.lock:
            if job.state != "queued":
                continue
            job.state = "finished"
        post(job, job.started, None)
        post(job, job.done, ("error", UserCodeError("lost", CLOSED)))


# ------------------------------------------------------------------------ the end of a run

OPEN_POOLS: "weakref.WeakSet[Pool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """No worker process outlives the controller, whatever path the run ended by."""
    for pool in list(OPEN_POOLS):
        try:
            pool.close()
        except Exception:
            pass

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
import collections
import ctypes
import functools
import inspect
import itertools
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

MODES = ("thread", "process", "inline")
REASONS = ("error", "timeout", "lost")
CLOSED = "the user-code pool is closed"
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds `eddyrl`
_MAX_FAILED_STARTS = 3  # worker processes that die before they are ready, in a row


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
    """Runs user code in one of MODES; see the module's docstring."""

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


def make_pool(mode: str, workers: int = 1, *, name: str = "user code",
              shared: Any = None) -> Pool:
    classes = {"inline": InlinePool, "thread": ThreadPool, "process": ProcessPool}
    if mode not in classes:
        raise ValueError(f"user-code mode {mode!r} is not one of {', '.join(MODES)}")
    return classes[mode](workers, name=name, shared=shared)


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

class _Job:
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


def _post(job: _Job, future: asyncio.Future, value: Any) -> None:
    """Resolve one of `job`'s futures from any thread."""
    try:
        job.loop.call_soon_threadsafe(_resolve, future, value)
    except RuntimeError:  # its loop is closed: nobody waits any more
        pass


class _Workers(Pool):
    """What the thread and process pools share: a call waits for its job to start, then for
    it to finish within `timeout_s`, past which the worker is given up (`_give_up`)."""

    async def _outcome(self, job: _Job, timeout_s: float | None) -> Any:
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

    async def _watch(self, job: _Job, timeout_s: float | None) -> tuple[str, Any]:
        await job.started
        if timeout_s is not None and not job.done.done():
            await asyncio.wait((job.done,), timeout=timeout_s)
            if not job.done.done() and self._give_up(job):
                self.timeouts += 1
                return "error", UserCodeError("timeout", self.timeout_note)
        return await job.done

    def _cancel(self, job: _Job) -> None:
        """The caller is gone: a job not started yet never runs; a running one runs on (its
        result is dropped), still bounded by its limit."""
        with job.lock:
            if job.state != "queued":
                return
            job.state = "cancelled"
        _resolve(job.started, None)
        _resolve(job.done, ("cancelled", None))

    def _give_up(self, job: _Job) -> bool:
        """`job` ran past its limit: stop waiting for its worker (False: it just finished)."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------ thread

def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Raise `exc_type` in `thread` at its next bytecode (CPython's async exception)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(exc_type))


def _run_sync(fn: Callable, args: tuple) -> Any:
    """`fn(*args)` on a worker thread; a coroutine function runs on a loop of its own."""
    result = fn(*args)
    if inspect.isawaitable(result):
        loop = asyncio.new_event_loop()
        try:
            result = loop.run_until_complete(_invoke(lambda: result, ()))
        finally:
            loop.close()
    return result


class _Exited(Exception):
    """User code raised SystemExit inside an event loop's task, carried out of it as an
    ordinary exception (a SystemExit escaping a task ends that loop's run); `describe` gives
    the SystemExit's own description."""


async def _invoke(fn: Callable, args: tuple) -> Any:
    try:
        result = fn(*args)
        return (await result) if inspect.isawaitable(result) else result
    except SystemExit as exc:
        raise _Exited(describe(exc)) from None


class _Thread:
    __slots__ = ("thread", "abandoned")

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.abandoned = False


class ThreadPool(_Workers):
    mode = "thread"
    timeout_note = "its thread was abandoned (Python cannot stop a thread) and replaced"

    def __init__(self, workers: int = 4, *, name: str = "user code", shared: Any = None) -> None:
        super().__init__(workers, name=name, shared=shared)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = self._idle = self._waiting = 0
        self._names = itertools.count()
        self.abandoned = 0  # threads given up on, past a limit (some may still be running)
        _POOLS.add(self)

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Any:
        return await self._submit(functools.partial(_run_sync, fn, args), timeout_s)

    def session(self) -> "ThreadSession":
        return ThreadSession(self)

    async def _submit(self, run: Callable[[], Any], timeout_s: float | None) -> Any:
        job = _Job(asyncio.get_running_loop(), run)
        with self._lock:
            if self.closed:
                raise UserCodeError("lost", CLOSED)
            self._waiting += 1
            self._queue.put(job)
            self._grow()
        return await self._outcome(job, timeout_s)

    def _grow(self) -> None:
        """Start a thread if jobs wait for one and the pool has room (lock held)."""
        if self._waiting > self._idle and self._live < self.workers:
            self._live += 1
            worker = _Thread()
            worker.thread = threading.Thread(target=self._work, args=(worker,), daemon=True,
                                             name=f"eddy-{self.name}-{next(self._names)}")
            worker.thread.start()

    def _work(self, worker: _Thread) -> None:
        pid = os.getpid()
        try:
            while True:
                with self._lock:
                    self._idle += 1
                job = self._queue.get()
                with self._lock:
                    self._idle -= 1
                    if job is None:  # the pool is closed
                        return
                    self._waiting -= 1
                with job.lock:
                    if job.state != "queued":  # its caller was cancelled
                        continue
                    job.state, job.worker = "running", worker
                _post(job, job.started, None)
                try:
                    outcome: tuple = ("ok", job.run())
                except KeyboardInterrupt:
                    outcome = ("interrupt", None)
                except BaseException as exc:  # SystemExit, and a UserCodeTimeout if late
                    outcome = ("error", UserCodeError("error", describe(exc)))
                if os.getpid() != pid:  # a fork's copy, back in the pool's hands
                    os._exit(0)
                with job.lock:
                    late, job.state = job.state != "running", "finished"
                if not late:
                    _post(job, job.done, outcome)
                job = outcome = None  # hold no result while idle
                if worker.abandoned:
                    return
        except UserCodeTimeout:  # raised just after its call returned: abandoned anyway
            return
        finally:
            if not worker.abandoned:
                with self._lock:
                    self._live -= 1

    def _give_up(self, job: _Job) -> bool:
        with job.lock:
            if job.state != "running":
                return False
            job.state = "abandoned"
            worker = job.worker
            worker.abandoned = True
            _raise_in(worker.thread, UserCodeTimeout)
        with self._lock:
            self._live -= 1
            self.abandoned += 1
            self.replaced += 1
            self._grow()
        return True

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pending = []
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    pending.append(job)
            self._waiting = 0
            for _ in range(self._live):
                self._queue.put(None)
        _lose_queued(pending)


def _lose_queued(jobs) -> None:
    """A closing pool's jobs that never started: each answered lost (closed), once."""
    for job in jobs:
        with job.lock:
            if job.state != "queued":
                continue
            job.state = "finished"
        _post(job, job.started, None)
        _post(job, job.done, ("error", UserCodeError("lost", CLOSED)))


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


class ThreadSession:
    """A session of a thread pool: its state and its own event loop, which the worker thread
    that takes a call runs for that call (tasks the code leaves behind run only then)."""

    def __init__(self, pool: ThreadPool) -> None:
        self.pool = pool
        self.state: SessionState | None = SessionState(pool.shared)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lost: str | None = None
        self._turn: asyncio.Lock | None = None

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Any:
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            if self.lost is not None:
                raise UserCodeError("lost", self.lost)
            try:
                return await self.pool._submit(functools.partial(self._run, fn, args),
                                               timeout_s)
            except UserCodeError as exc:
                if exc.reason == "timeout":
                    self.lost = ("its thread was abandoned after an earlier call ran past its "
                                 "limit")
                raise

    def _run(self, fn: Callable, args: tuple) -> Any:  # on a worker thread
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(_invoke(fn, (self.state, *args)))

    async def close(self, timeout_s: float | None = None) -> None:
        """Drop the state and close the session's loop (not one stuck in an abandoned
        thread: that one is left to it)."""
        if self.lost is not None:
            return
        self.lost, self.state = "the session is closed", None
        if self.loop is not None:
            try:
                await self.pool._submit(functools.partial(_close_loop, self.loop), timeout_s)
            except UserCodeError:
                pass


# ----------------------------------------------------------------------------------- process

def _exit_description(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"died ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"died (signal {-returncode})"
    return f"exited (status {returncode})"


class _Process:
    """One worker process, and the two threads that talk to it: a writer (so that the event
    loop never blocks on a full pipe) and a reader (which also learns of its death)."""

    def __init__(self, pool: "ProcessPool", number: int) -> None:
        self.pool = pool
        self.inflight: dict[int, _Job] = {}
        self.waiting: list[_Job] = []  # session calls sent before it was ready
        self.ready = self.dead = False
        self.sessions = 0
        self.why_lost: str | None = None  # set when the pool kills or closes it
        ours, theirs = socket.socketpair()
        self.socket = ours
        self.conn = Connection(os.dup(ours.fileno()))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "eddyrl.usercode.child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)
        finally:
            theirs.close()
        self.pid = self.popen.pid
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox.put(pool._path)
        self.outbox.put(pool._shared)
        for target, role in ((self._write, "writer"), (self._read, "reader")):
            threading.Thread(target=target, daemon=True,
                             name=f"eddy-{pool.name}-{number}-{role}").start()

    @property
    def usable(self) -> bool:
        """Ready, and neither dead nor being killed or closed."""
        return self.ready and not self.dead and self.why_lost is None

    def _write(self) -> None:
        try:
            while (data := self.outbox.get()) is not None:
                self.conn.send_bytes(data)
        except OSError:  # it is gone; the reader tells the pool
            pass

    def _read(self) -> None:
        try:
            while True:
                self.pool._message(self, self.conn.recv())
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        try:
            returncode = self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it closed its end but lives on
            self.kill()
            returncode = self.popen.wait()
        self.outbox.put(None)
        self.conn.close()
        self.socket.close()
        self.pool._exited(self, returncode)

    def kill(self) -> None:
        """SIGKILL to its process group (what the user code started too), if it is still
        ours (not reaped: its id cannot belong to another process yet)."""
        if self.popen.poll() is None:
            for kill in (lambda: os.killpg(self.pid, signal.SIGKILL), self.popen.kill):
                try:
                    kill()
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.socket.shutdown(socket.SHUT_RDWR)  # wakes the reader even if a fork holds it
        except OSError:
            pass


class ProcessPool(_Workers):
    mode = "process"
    timeout_note = "its worker process was killed and replaced"

    def __init__(self, workers: int = 2, *, name: str = "user code", shared: Any = None) -> None:
        super().__init__(workers, name=name, shared=shared)
        try:
            self._shared = pickle.dumps(shared)
        except Exception as exc:
            raise TypeError(f"the {name} pool's shared object cannot be sent to a worker "
                            f"process ({describe(exc)})") from None
        self._path = pickle.dumps(list(sys.path))
        self._lock = threading.Lock()
        self._procs: list[_Process] = []
        # session calls made while no worker process was there to take the session (between
        # a death and its replacement): housed by the next one
        self._homeless: list[tuple["ProcessSession", _Job]] = []
        self._queue: collections.deque[_Job] = collections.deque()
        self._ids = itertools.count(1)
        self._numbers = itertools.count(workers)  # names of replacement processes
        self._sessions = itertools.count(1)
        self._started = False
        self._failed_starts = 0
        self._init_error: str | None = None
        self.broken: str | None = None  # no worker process could be started
        _POOLS.add(self)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, as they are now."""
        with self._lock:
            return [p.pid for p in self._procs if p.why_lost is None]

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Any:
        return await self._submit(fn, args, timeout_s)

    def session(self) -> "ProcessSession":
        """A session, housed by the worker process with the fewest at its first call."""
        with self._lock:
            self._start()
        return ProcessSession(self, next(self._sessions))

    def _house(self, session: "ProcessSession") -> "_Process | None":  # lock held
        live = [p for p in self._procs if p.why_lost is None]
        if not live:
            return None
        session.proc = min(live, key=lambda p: p.sessions)
        session.proc.sessions += 1
        return session.proc

    def _start(self) -> None:
        """The workers, at first use (lock held)."""
        if not self._started and not self.closed:
            self._started = True
            self._procs = [_Process(self, i) for i in range(self.workers)]

    async def _submit(self, fn: Callable, args: tuple, timeout_s: float | None,
                      session: "ProcessSession | None" = None) -> Any:
        try:
            call = pickle.dumps((fn, args))
        except Exception as exc:
            raise UserCodeError("error", f"the call cannot be sent to a worker process "
                                         f"({describe(exc)})") from None
        job_id = next(self._ids)
        job = _Job(asyncio.get_running_loop(), job_id=job_id, payload=pickle.dumps(
            ("call", job_id, None if session is None else session.id, call)))
        with self._lock:
            if self.closed:
                raise UserCodeError("lost", CLOSED)
            if self.broken is not None:
                raise UserCodeError("lost", self.broken)
            self._start()
            if session is None:
                self._queue.append(job)
                self._dispatch()
            else:
                proc = session.proc or self._house(session)
                if proc is None:
                    self._homeless.append((session, job))
                elif proc.dead or proc.why_lost is not None:
                    raise UserCodeError("lost", session.why_lost())
                elif proc.ready:
                    self._send(proc, job)
                else:
                    proc.waiting.append(job)
        return await self._outcome(job, timeout_s)

    def _send(self, proc: _Process, job: _Job) -> None:  # lock held
        with job.lock:
            if job.state != "queued":
                return
            job.state, job.worker = "running", proc
        proc.inflight[job.id] = job
        proc.outbox.put(job.payload)
        _post(job, job.started, None)

    def _dispatch(self) -> None:
        """Calls without a session go to an idle, ready worker, one each (lock held)."""
        while self._queue:
            proc = next((p for p in self._procs if p.usable and not p.inflight), None)
            if proc is None:
                return
            self._send(proc, self._queue.popleft())

    def _message(self, proc: _Process, message: tuple) -> None:  # on its reader thread
        kind = message[0]
        with self._lock:
            if kind == "ready":
                proc.ready, self._failed_starts = True, 0
                waiting, proc.waiting = proc.waiting, []
                for job in waiting:
                    self._send(proc, job)
                self._dispatch()
            elif kind == "init_failed":
                self._init_error = message[1]
            elif kind == "done":
                _, job_id, outcome, value = message
                job = proc.inflight.pop(job_id, None)
                if outcome == "error":
                    value = UserCodeError("error", value)
                if job is not None:
                    with job.lock:
                        late, job.state = job.state != "running", "finished"
                    if not late:
                        _post(job, job.done, (outcome, value))
                self._dispatch()

    def _exited(self, proc: _Process, returncode: int) -> None:  # on its reader thread
        with self._lock:
            proc.dead = True
            if proc in self._procs:
                self._procs.remove(proc)
            lost = list(proc.inflight.values()) + proc.waiting
            proc.inflight, proc.waiting = {}, []
            queued: list[_Job] = []
            if not proc.ready:
                self._failed_starts += 1
                if self._failed_starts >= _MAX_FAILED_STARTS and self.broken is None:
                    self.broken = (f"no {self.name} worker process could be started "
                                   f"({self._init_error or _exit_description(returncode)})")
                    queued = list(self._queue) + [job for _, job in self._homeless]
                    self._queue.clear()
                    self._homeless.clear()
            replace = not self.closed and self.broken is None
            proc.why_lost = proc.why_lost or f"its worker process " \
                f"{_exit_description(returncode)}" + (" and was replaced" if replace else "")
        if replace:  # started outside the lock: the loop's calls need not wait for it
            fresh = _Process(self, next(self._numbers))
            with self._lock:
                replace = not self.closed
                if replace:
                    self._procs.append(fresh)
                    self.replaced += 1
                    homeless, self._homeless = self._homeless, []
                    for session, job in homeless:
                        home = session.proc or self._house(session)
                        if home.ready:  # it may have answered already
                            self._send(home, job)
                        else:
                            home.waiting.append(job)
            if not replace:
                fresh.why_lost = CLOSED
                fresh.outbox.put(None)
                fresh.kill()
        for jobs, why in ((lost, proc.why_lost), (queued, self.broken)):
            for job in jobs:
                with job.lock:
                    if job.state not in ("queued", "running"):
                        continue
                    job.state = "finished"
                _post(job, job.started, None)
                _post(job, job.done, ("error", UserCodeError("lost", why)))

    def _give_up(self, job: _Job) -> bool:
        with job.lock:
            if job.state != "running":
                return False
            job.state = "abandoned"
        proc = job.worker
        with self._lock:
            proc.inflight.pop(job.id, None)
            if proc.why_lost is None:
                proc.why_lost = ("its worker process was killed: another call on it ran past "
                                 "its limit")
        proc.kill()
        return True

    def _drop(self, session: "ProcessSession") -> None:
        with self._lock:
            proc = session.proc
            if proc is not None:
                proc.sessions -= 1
                if not proc.dead:
                    proc.outbox.put(pickle.dumps(("drop", session.id)))

    def close(self, grace_s: float = 2.0) -> None:
        """End every worker process: each is told (its connection closed), then killed if it
        has not ended within `grace_s` in all."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            procs = list(self._procs)
            queued = list(self._queue) + [job for _, job in self._homeless]
            self._queue.clear()
            self._homeless.clear()
            for proc in procs:
                proc.why_lost = proc.why_lost or CLOSED
        _lose_queued(queued)
        for proc in procs:
            proc.outbox.put(None)
            try:
                proc.socket.shutdown(socket.SHUT_RDWR)  # the child reads EOF and ends
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.popen.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.popen.wait()


class ProcessSession:
    """A session of a process pool: its state lives in one worker process."""

    def __init__(self, pool: ProcessPool, number: int) -> None:
        self.pool, self.id = pool, number
        self.proc: _Process | None = None  # its worker process, from its first call
        self.closed = False
        self._turn: asyncio.Lock | None = None

    def why_lost(self) -> str:
        if self.proc is None:
            return self.pool.broken or CLOSED
        return self.proc.why_lost or "its worker process is gone"

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Any:
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            if self.closed:
                raise UserCodeError("lost", "the session is closed")
            return await self.pool._submit(fn, args, timeout_s, session=self)

    async def close(self, timeout_s: float | None = None) -> None:
        if not self.closed:
            self.closed = True
            self.pool._drop(self)


# ------------------------------------------------------------------------ the end of a run

_POOLS: "weakref.WeakSet[Pool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """No worker process outlives the controller, whatever path the run ended by."""
    for pool in list(_POOLS):
        try:
            pool.close()
        except Exception:
            pass

"""The thread pool: user code on worker threads (see `pool` for the modes and their contract)."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import inspect
import itertools
import os
import queue
import threading
from typing import Any, Callable

from .pool import (CLOSED, OPEN_POOLS, Job, SessionState, UserCodeError, UserCodeTimeout,
                   WorkerPool, describe, invoke, lose_queued, post)
from .process_state import GUARD


def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Raise `exc_type` in `thread` at its next bytecode (CPython's async exception)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(exc_type))


def _run_sync(fn: Callable, args: tuple, pool: str) -> Any:
    """`fn(*args)` on a worker thread; a coroutine function runs on a loop of its own. The
    process-wide state it changes (torch's default dtype, the umask...) is put back after."""
    with GUARD.around(fn, pool):
        result = fn(*args)
        if inspect.isawaitable(result):
            loop = asyncio.new_event_loop()
            try:
                result = loop.run_until_complete(invoke(lambda: result, ()))
            finally:
                loop.close()
        return result


class _Thread:
    __slots__ = ("thread", "abandoned")

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.abandoned = False


class ThreadPool(WorkerPool):
    mode = "thread"
    timeout_note = "its thread was abandoned (Python cannot stop a thread) and replaced"

    def __init__(self, workers: int = 4, *, name: str = "user code", shared: Any = None) -> None:
        super().__init__(workers, name=name, shared=shared)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = self._idle = self._waiting = 0
        self._names = itertools.count()
        self.abandoned = 0  # threads given up on, past a limit (some may still be running)
        OPEN_POOLS.add(self)

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Any:
        return await self._submit(functools.partial(_run_sync, fn, args, self.name), timeout_s)

    def session(self) -> "ThreadSession":
        return ThreadSession(self)

    async def _submit(self, run: Callable[[], Any], timeout_s: float | None) -> Any:
        job = Job(asyncio.get_running_loop(), run)
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
                post(job, job.started, None)
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
                    post(job, job.done, outcome)
                job = outcome = None  # hold no result while idle
                if worker.abandoned:
                    return
        except UserCodeTimeout:  # raised just after its call returned: abandoned anyway
            return
        finally:
            if not worker.abandoned:
                with self._lock:
                    self._live -= 1

    def _give_up(self, job: Job) -> bool:
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
        lose_queued(pending)


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
        owner = fn if self.pool.shared is None else self.pool.shared  # the environment's class
        with GUARD.around(owner, self.pool.name):
            return self.loop.run_until_complete(invoke(fn, (self.state, *args)))

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

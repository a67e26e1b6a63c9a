"""The process pool: user code in worker processes, `python -m eddyrl.usercode.child` (see
`pool` for the modes and their contract)."""

from __future__ import annotations

import asyncio
import collections
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
from multiprocessing.connection import Connection
from typing import Any, Callable

from .pool import (CLOSED, MAX_FAILED_STARTS, OPEN_POOLS, PACKAGE_ROOT, Job, UserCodeError,
                   WorkerPool, describe, lose_queued, post)


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
        self.inflight: dict[int, Job] = {}
        self.waiting: list[Job] = []  # session calls sent before it was ready
        self.ready = self.dead = False
        self.sessions = 0
        self.why_lost: str | None = None  # set when the pool kills or closes it
        ours, theirs = socket.socketpair()
        self.socket = ours
        self.conn = Connection(os.dup(ours.fileno()))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
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


class ProcessPool(WorkerPool):
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
        self._homeless: list[tuple["ProcessSession", Job]] = []
        self._queue: collections.deque[Job] = collections.deque()
        self._ids = itertools.count(1)
        self._numbers = itertools.count(workers)  # names of replacement processes
        self._sessions = itertools.count(1)
        self._started = False
        self._failed_starts = 0
        self._init_error: str | None = None
        self.broken: str | None = None  # no worker process could be started
        OPEN_POOLS.add(self)

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
        job = Job(asyncio.get_running_loop(), job_id=job_id, payload=pickle.dumps(
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

    def _send(self, proc: _Process, job: Job) -> None:  # lock held
        with job.lock:
            if job.state != "queued":
                return
            job.state, job.worker = "running", proc
        proc.inflight[job.id] = job
        proc.outbox.put(job.payload)
        post(job, job.started, None)

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
                        post(job, job.done, (outcome, value))
                self._dispatch()

    def _exited(self, proc: _Process, returncode: int) -> None:  # on its reader thread
        with self._lock:
            proc.dead = True
            if proc in self._procs:
                self._procs.remove(proc)
            lost = list(proc.inflight.values()) + proc.waiting
            proc.inflight, proc.waiting = {}, []
            queued: list[Job] = []
            if not proc.ready:
                self._failed_starts += 1
                if self._failed_starts >= MAX_FAILED_STARTS and self.broken is None:
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
                post(job, job.started, None)
                post(job, job.done, ("error", UserCodeError("lost", why)))

    def _give_up(self, job: Job) -> bool:
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
        lose_queued(queued)
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

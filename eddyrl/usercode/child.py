"""A worker process of a user-code pool (`pool.ProcessPool`), started as
`python -m eddyrl.usercode.child FD`, FD its end of a socket pair with the controller.

It reads the controller's `sys.path` and the pool's shared object, answers "ready", then runs
every call it is sent as a task of its one event loop, in its main thread (so that code which
sets SIGALRM, as math-verify does, can): `fn(*args)`, or `fn(state, *args)` for a session's call
with that session's state, awaited when it is a coroutine. The answer is ("done", id, "ok",
result), ("done", id, "error", "Type: text") or ("done", id, "interrupt", None). A thread reads
the controller's messages; when the controller closes its end (the pool is closed, or the
controller died), the process ends at once, whatever it was running. Ctrl-C is ignored: it is
the controller's to handle (the pool starts each process in a session of its own).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection


def main(fd: int) -> None:
    try:
        _serve(fd)
    except (EOFError, OSError):  # the controller closed its end while this one started
        os._exit(0)


def _serve(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    # A fork in user code must not hold the controller's connection open after this process
    # dies, nor read from it.
    os.register_at_fork(after_in_child=lambda: _close_quietly(fd))
    pid = os.getpid()
    sys.path[:0] = [p for p in pickle.loads(conn.recv_bytes()) if p not in sys.path]
    from eddyrl.usercode.pool import SessionState, describe

    try:
        shared = pickle.loads(conn.recv_bytes())
    except BaseException as exc:  # the shared object does not load here: nothing can run
        conn.send(("init_failed", describe(exc)))
        os._exit(1)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    sessions: dict[int, SessionState] = {}
    sending = threading.Lock()

    def send(message: tuple) -> None:
        with sending:
            conn.send(message)

    async def handle(job_id: int, session: int | None, call: bytes) -> None:
        try:
            fn, args = pickle.loads(call)
            if session is not None:
                args = (sessions.setdefault(session, SessionState(shared)), *args)
            result = fn(*args)
            if inspect.isawaitable(result):
                result = await result
            outcome = ("ok", result)
        except KeyboardInterrupt:
            outcome = ("interrupt", None)
        except BaseException as exc:  # SystemExit included: the call's failure
            outcome = ("error", describe(exc))
        if os.getpid() != pid:  # a fork's copy, back in the pool's hands: it ends here
            os._exit(0)
        try:
            send(("done", job_id, *outcome))
        except Exception as exc:  # the result does not pickle: nothing was sent yet
            send(("done", job_id, "error", f"its result cannot be sent back ({describe(exc)})"))

    def dispatch(message: tuple) -> None:
        if message[0] == "call":
            loop.create_task(handle(*message[1:]))
        elif message[0] == "drop":
            sessions.pop(message[1], None)

    def receive() -> None:
        try:
            while True:
                loop.call_soon_threadsafe(dispatch, pickle.loads(conn.recv_bytes()))
        except BaseException:
            pass
        os._exit(0)  # the controller closed the pool, or is gone

    send(("ready", pid))
    threading.Thread(target=receive, daemon=True, name="eddy-user-code-reader").start()
    loop.run_forever()


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]))

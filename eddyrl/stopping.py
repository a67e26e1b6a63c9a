"""Stopping a run by signal. Ctrl-C (SIGINT), SIGTERM and SIGHUP (the terminal closed) end `eddy
train` the same way, whatever the runtime: the run's `asyncio.run` cancels its work and unwinds,
what the run started is shut down (Ray or the in-process trainer, the user-code pools, the
metrics sinks, the rendezvous directory), and the CLI says at which step it stopped and how to
go on (exit status 130, 143 or 129, as a shell reports a process those signals ended).

`stop_signals_as_interrupt` is that one mechanism: `eddy train` sets it before the run starts
(Python's default for SIGTERM and SIGHUP ends the process on the spot, leaving the run
directory half cleaned up), and `start_ray` sets it again after `ray.init`, which replaces the
SIGTERM handler twice: with its own Python one (`sys.exit`), and then with its core worker's
C++ failure handler, which prints a stack dump and aborts (rc 134). Such a signal then calls
whatever handles SIGINT at that moment (asyncio's, which cancels the main task; else a
KeyboardInterrupt is raised) and is remembered, so that the CLI can tell them apart.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_received: list[int] = []  # the stop signals received, in order
# taken as Ctrl-C: the terminal closing (SIGHUP) stops a run as `kill` (SIGTERM) does
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _on_stop_signal(signum, frame) -> None:
    _received.append(signum)
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signal.SIGINT, frame)  # asyncio.Runner's: cancel the main task, KeyboardInterrupt
        return
    raise KeyboardInterrupt


def stop_signals_as_interrupt() -> None:
    """From now on SIGTERM and SIGHUP stop the run as Ctrl-C does. Only the main thread can
    set it."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _on_stop_signal)


@contextlib.contextmanager
def signals_stop_the_run():
    """`stop_signals_as_interrupt` for one run; the handlers before it are put back after (a
    test that runs `eddy train` in its own process keeps its own)."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} if on_main else {}
    stop_signals_as_interrupt()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def stop_signal() -> signal.Signals:
    """The signal a KeyboardInterrupt stands for: the first SIGTERM or SIGHUP that came, else
    SIGINT."""
    return signal.Signals(_received[0]) if _received else signal.SIGINT


def exit_status(signum: int) -> int:
    return 128 + signum

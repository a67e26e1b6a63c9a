"""Stopping a run by signal. Ctrl-C (SIGINT) and SIGTERM end `eddy train` the same way: the
run's `asyncio.run` cancels its work and unwinds, what the run started is shut down (Ray, the
user-code pools, the metrics sinks), and the CLI says at which step it stopped and how to go on
(exit status 130 or 143, as a shell reports a process those signals ended).

`ray.init` replaces the SIGTERM handler twice: with its own Python one (`sys.exit`), and then
with its core worker's C++ failure handler, which prints a stack dump and aborts (rc 134).
`sigterm_as_interrupt` therefore runs after `ray.init`: SIGTERM then calls whatever handles
SIGINT at that moment (asyncio's, which cancels the main task; else a KeyboardInterrupt is
raised) and is remembered, so that the CLI can tell the two apart.
"""

from __future__ import annotations

import signal
import threading

_received: list[int] = []  # the stop signals received, in order


def _on_sigterm(signum, frame) -> None:
    _received.append(signum)
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signal.SIGINT, frame)  # asyncio.Runner's: cancel the main task, KeyboardInterrupt
        return
    raise KeyboardInterrupt


def sigterm_as_interrupt() -> None:
    """From now on SIGTERM stops the run as Ctrl-C does. Only the main thread can set it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def stop_signal() -> signal.Signals:
    """The signal a KeyboardInterrupt stands for: SIGTERM if one came, else SIGINT."""
    return signal.SIGTERM if signal.SIGTERM in _received else signal.SIGINT


def exit_status(signum: int) -> int:
    return 128 + signum

"""An asyncio event loop on virtual time: what lets the real controller run against simulated
engines at cluster scale in seconds.

`loop.time()` is a number the loop advances itself: whenever no callback is ready, it jumps
straight to the earliest scheduled wake-up (a `sleep`, a `wait_for` deadline) instead of
waiting for it, so simulated seconds cost no real time and every coroutine that takes its time
from the loop — `asyncio.sleep`, timeouts, `runtime.now()` — sees the same virtual clock. Real
I/O (a thread finishing, a socket) is still polled at each step, without blocking.

If nothing is ready and nothing is scheduled, a real loop would wait forever; this one waits a
moment for real I/O and then raises `SimulationStalled`: in a simulation that is a deadlock
(someone waits for an event no one will set), and it should be named, not hang.
"""

from __future__ import annotations

import asyncio
import gc
import selectors
from contextlib import contextmanager
from typing import Awaitable, Iterator, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Nothing can ever happen again: every coroutine waits and no wake-up is scheduled."""


# Turns of the loop with callbacks ready that may go by without polling real I/O.
POLL_EVERY = 64


class _JumpingSelector(selectors.DefaultSelector):
    """Polls real I/O without blocking; a timeout becomes a jump of the virtual clock."""

    def __init__(self, real_wait_s: float) -> None:
        super().__init__()
        self.real_wait_s = real_wait_s
        self.loop: VirtualTimeLoop | None = None
        self._unpolled = 0  # turns of the loop since real I/O was last polled

    def select(self, timeout: float | None = None):
        if timeout == 0 and self._unpolled < POLL_EVERY:
            # Callbacks are ready at this instant (most turns of a simulation): they run first
            # and real I/O is polled before the clock moves, which saves a system call a turn.
            # Callbacks from threads are queued without polling (call_soon_threadsafe); and
            # every POLL_EVERY turns it polls anyway, for a coroutine that spins on sleep(0).
            self._unpolled += 1
            return []
        self._unpolled = 0
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # nothing scheduled: only real I/O (a thread) could wake anyone
            events = super().select(self.real_wait_s)
            if not events:
                raise SimulationStalled(
                    f"virtual time {self.loop.time():.3f} s: nothing is ready and nothing is "
                    "scheduled (every coroutine waits for something no one will do)")
            return events
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0, real_wait_s: float = 1.0) -> None:
        selector = _JumpingSelector(real_wait_s)
        super().__init__(selector)
        selector.loop = self
        self._now = start
        self.jumps = 0  # how often the clock jumped: a measure of simulation work

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"virtual time cannot go back ({seconds} s)")
        self._now += seconds
        self.jumps += 1


def run_virtual(main: Awaitable[T], start: float = 0.0) -> tuple[T, float]:
    """Run `main` to completion on virtual time; returns its result and the virtual seconds it
    took."""
    loop = VirtualTimeLoop(start)
    try:
        asyncio.set_event_loop(loop)
        with _fewer_collections():
            result = loop.run_until_complete(main)
        return result, loop.time() - start
    finally:
        asyncio.set_event_loop(None)
        loop.close()


# Young objects allocated between two collections of the youngest generation during a run
# (Python's default is 700).
SIM_GC_THRESHOLD = 50_000


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run with the cyclic garbage collector mostly out of the way; restored afterwards.

    A simulated run allocates millions of small objects, most of them short-lived (results,
    timer handles, coroutine frames), on top of the hundreds of thousands that the imports and
    the built run leave alive. At Python's defaults the collector took about a quarter of the
    CPU of `eddy sim scale_1024` (full collections scanning everything alive, again and again).
    Freezing what exists at the start (never collected until `unfreeze`) and collecting the
    young generation every 50K allocations instead of 700 cuts that to a few percent. Nothing
    is simulated differently: reference counting still frees almost everything at once, and
    the collector still runs, only less often."""
    thresholds = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0  # a caller's own frozen objects stay frozen
    if freeze:
        gc.freeze()
    gc.set_threshold(SIM_GC_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()

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
import selectors
from typing import Awaitable, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Nothing can ever happen again: every coroutine waits and no wake-up is scheduled."""


class _JumpingSelector(selectors.DefaultSelector):
    """Polls real I/O without blocking; a timeout becomes a jump of the virtual clock."""

    def __init__(self, real_wait_s: float) -> None:
        super().__init__()
        self.real_wait_s = real_wait_s
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None):
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
        result = loop.run_until_complete(main)
        return result, loop.time() - start
    finally:
        asyncio.set_event_loop(None)
        loop.close()

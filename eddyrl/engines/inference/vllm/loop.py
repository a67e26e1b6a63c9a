"""Concurrency plumbing of the `vllm` engine: the private event loop vLLM's client objects live
on, and the cap on requests decoding at once. Neither knows anything about vLLM."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable


class Slots:
    """At most `size` requests decode at once; the rest wait here (and leave when aborted)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self._changed = asyncio.Condition()

    async def acquire(self, leave: Callable[[], bool]) -> bool:
        async with self._changed:
            await self._changed.wait_for(lambda: leave() or self.used < self.size)
            if leave():
                return False
            self.used += 1
            return True

    async def release(self, count: int = 1) -> None:
        self.used -= count
        await self.notify()

    async def resize(self, size: int) -> None:
        self.size = size
        await self.notify()

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class LoopThread:
    """A private event loop in a daemon thread, where vLLM's client objects live."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="eddy-vllm",
                                       daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def call(self, coro):
        """Await `coro` on the private loop from any other loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def run(self, coro):
        """Run `coro` on the private loop and block until it is done (not from that loop)."""
        if threading.current_thread() is self.thread:
            raise RuntimeError("blocking call made on the vLLM adapter's own loop")
        return self.submit(coro).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()



"""The virtual clock's shortcuts for speed change nothing observable: real I/O is still seen by
a coroutine that spins on sleep(0) while callbacks keep being ready (polled every POLL_EVERY
turns instead of every turn), and the garbage collector's settings are put back after a run."""

import asyncio
import gc
import socket

from eddyrl.sim.clock import POLL_EVERY, run_virtual


def test_real_io_is_seen_while_callbacks_keep_the_loop_busy():
    reader, writer = socket.socketpair()
    try:
        writer.send(b"x")  # ready before the loop starts: only a poll can tell it

        async def main():
            loop = asyncio.get_running_loop()
            arrived = asyncio.Event()
            loop.add_reader(reader.fileno(), arrived.set)
            try:
                for turns in range(100 * POLL_EVERY):  # never idle: the clock never moves
                    if arrived.is_set():
                        return turns
                    await asyncio.sleep(0)
                return None
            finally:
                loop.remove_reader(reader.fileno())

        turns, took = run_virtual(main())
        assert turns is not None and turns <= 2 * POLL_EVERY
        assert took == 0.0
    finally:
        reader.close()
        writer.close()


def test_the_collector_is_as_it_was_after_a_run_even_a_failed_one():
    before = gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()

    async def fails():
        await asyncio.sleep(1)
        raise RuntimeError("boom")

    async def returns():
        await asyncio.sleep(1)
        return gc.get_threshold()[0]

    inside, _ = run_virtual(returns())
    assert inside != before[0][0]  # a run collects less often ...
    try:
        run_virtual(fails())
    except RuntimeError:
        pass
    assert (gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()) == before  # ... then not

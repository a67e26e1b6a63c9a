"""The virtual clock: simulated seconds cost no real time, order and timeouts hold, and a
deadlock is named instead of hanging."""

import asyncio

import pytest

from eddyrl.sim.runs import Runs
from eddyrl.sim.clock import SimulationStalled, run_virtual


def test_sleeps_jump_in_order_and_timeouts_fire_on_virtual_time():
    async def main():
        loop = asyncio.get_running_loop()
        seen = []

        async def sleeper(name, seconds):
            await asyncio.sleep(seconds)
            seen.append((name, loop.time()))

        await asyncio.gather(sleeper("hour", 3600), sleeper("ten", 10), sleeper("week", 604800))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 5)
        return seen, loop.time()

    (seen, end), took = run_virtual(main())  # a real week of sleeps would hit the timeout
    assert seen == [("ten", 10.0), ("hour", 3600.0), ("week", 604800.0)]
    assert end == took == 604805.0


def test_a_wait_that_nothing_can_end_is_reported_not_hung():
    async def stuck():
        await asyncio.Event().wait()

    with pytest.raises(SimulationStalled, match="nothing is scheduled"):
        run_virtual(stuck())


def test_runs_behave_like_the_lists_they_stand_for():
    runs = Runs([(0, 3), (1, 2)]) + [1, 1, 2]
    as_list = [0, 0, 0, 1, 1, 1, 1, 2]
    assert runs == as_list and list(runs) == as_list and len(runs) == 8
    assert runs.runs() == [(0, 3), (1, 4), (2, 1)]  # neighbours merge
    assert [runs[i] for i in (0, 3, -1)] == [0, 1, 2]
    assert runs[2:6] == as_list[2:6] and runs[::3] == as_list[::3]
    assert [7] + Runs([(0, 2)]) == [7, 0, 0]
    assert set(Runs([(3, 1000000)])) == {3} and len(Runs([(3, 10**9)])) == 10**9
    with pytest.raises(IndexError):
        runs[8]

"""The user-code pool on worker threads and inline (tests/integration/usercode/test_process_pool.py: in
worker processes): whatever user code does — block past its limit, spin, raise SystemExit or
anything else, return the wrong type — costs its call (a UserCodeError: error, timeout, lost),
never the caller; a worker thread given up on is replaced and later calls succeed; a
KeyboardInterrupt is raised on. No test depends on how long anything takes beyond "finished"
and "still blocked until released"."""

import asyncio
import functools
import threading

import pytest
from usercode_fixtures import (add, blocks, exits, interrupts, raises, remember,
                               remember_async, spins, thread_name, wrong_type)

from eddyrl.core.rewarding import SafeReward
from eddyrl.usercode import InlinePool, ThreadPool, UserCodeError, make_pool

LIMIT = 0.3  # seconds: a call running longer is cut off


@pytest.fixture
def release():
    event = threading.Event()
    yield event
    event.set()  # threads still blocked go free


async def _failure(pool, fn, *args, timeout_s=LIMIT) -> UserCodeError:
    with pytest.raises(UserCodeError) as error:
        await pool.call(fn, *args, timeout_s=timeout_s)
    return error.value


def test_a_call_runs_on_a_worker_thread_while_the_loop_goes_on(release):
    async def scenario():
        with ThreadPool(2, name="reward") as pool:
            blocked = asyncio.ensure_future(pool.call(blocks, release))
            assert await pool.call(add, 1, 2) == 3  # another call, while one blocks
            for _ in range(3):
                await asyncio.sleep(0.01)  # and the loop runs
            assert not blocked.done()
            release.set()
            assert await blocked == 1.0
            assert (await pool.call(thread_name)).startswith("eddy-reward-")

    asyncio.run(scenario())


def test_a_call_blocking_past_its_limit_times_out_and_its_thread_is_replaced(release):
    async def scenario():
        with ThreadPool(1) as pool:
            error = await _failure(pool, blocks, release)
            assert error.reason == "timeout" and "abandoned" in error.message
            assert (pool.timeouts, pool.abandoned, pool.replaced) == (1, 1, 1)
            # the only worker is stuck: a fresh thread takes the next calls
            assert await pool.call(add, 2, 2) == 4
            assert await pool.call(add, 3, 3, timeout_s=30) == 6

    asyncio.run(scenario())


def test_code_that_spins_is_stopped_when_its_thread_is_given_up():
    stopped = threading.Event()

    async def scenario():
        with ThreadPool(1) as pool:
            error = await _failure(pool, functools.partial(spins, stopped=stopped))
            assert error.reason == "timeout"
            # a UserCodeTimeout raised into the thread ends the loop its `except Exception`
            # would keep going
            assert await asyncio.to_thread(stopped.wait, 30)

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["thread", "inline"])
@pytest.mark.parametrize("fn, message", [
    (exits, "SystemExit: 3"),
    (raises, "ZeroDivisionError: grader divided by zero"),
])
def test_system_exit_or_an_exception_costs_the_call_only(mode, fn, message):
    async def scenario():
        with make_pool(mode, 1) as pool:
            error = await _failure(pool, fn)
            assert (error.reason, error.message) == ("error", message)
            assert await pool.call(add, 1, 1) == 2

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_keyboard_interrupt_in_user_code_reaches_the_caller(mode):
    pool = make_pool(mode, 1)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(pool.call(interrupts))
    pool.close()


def test_a_call_whose_caller_is_cancelled_before_it_starts_never_runs(release):
    ran = []

    async def scenario():
        with ThreadPool(1) as pool:
            first = asyncio.ensure_future(pool.call(blocks, release))
            second = asyncio.ensure_future(pool.call(ran.append, "second"))
            await asyncio.sleep(0.01)
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            release.set()
            assert await first == 1.0
            await pool.call(ran.append, "third")  # after the second's turn in the queue

    asyncio.run(scenario())
    assert ran == ["third"]


def test_closing_the_pool_fails_the_waiting_calls_and_refuses_new_ones(release):
    started = threading.Event()

    def starts_then_blocks():
        started.set()
        return blocks(release)

    async def scenario():
        pool = ThreadPool(1)
        running = asyncio.ensure_future(pool.call(starts_then_blocks))
        waiting = asyncio.ensure_future(pool.call(add, 1, 1))
        assert await asyncio.to_thread(started.wait, 30)
        pool.close()
        with pytest.raises(UserCodeError, match="closed") as error:
            await waiting
        assert error.value.reason == "lost"
        with pytest.raises(UserCodeError, match="closed"):
            await pool.call(add, 1, 1)
        release.set()
        assert await running == 1.0  # a call already running finishes

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_a_session_keeps_its_state_across_calls_apart_from_other_sessions(mode):
    async def scenario():
        with make_pool(mode, 2) as pool:
            one, two = pool.session(), pool.session()
            assert (await one.call(remember, 1))[0] == 1
            assert (await one.call(remember_async, 2))[0] == 3  # a coroutine function
            assert (await two.call(remember, 10))[0] == 10
            await one.close()
            with pytest.raises(UserCodeError):
                await one.call(remember, 1)

    asyncio.run(scenario())


def test_a_session_whose_call_blocks_past_its_limit_is_lost_the_others_go_on(release):
    async def scenario():
        with ThreadPool(2) as pool:
            stuck, fine = pool.session(), pool.session()
            await stuck.call(remember, 1)
            with pytest.raises(UserCodeError) as error:
                await stuck.call(lambda state: blocks(release), timeout_s=LIMIT)
            assert error.value.reason == "timeout"
            with pytest.raises(UserCodeError, match="abandoned") as error:
                await stuck.call(remember, 1)
            assert error.value.reason == "lost"
            assert (await fine.call(remember, 5))[0] == 5
            await stuck.close()  # nothing to do: its loop is the abandoned thread's
            await fine.close()

    asyncio.run(scenario())


def test_inline_cuts_off_a_coroutine_at_its_limit_and_passes_cancellation_on():
    async def hangs():
        await asyncio.sleep(30)

    async def scenario():
        pool = InlinePool()
        error = await _failure(pool, hangs)
        assert error.reason == "timeout"
        call = asyncio.ensure_future(pool.call(hangs))
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):  # the caller's cancellation, not an error
            await call

    asyncio.run(scenario())


# --------------------------------------------------------------------- rewards in the pool

def _by_answer(release):
    def reward(response, answer):
        if answer == "block":
            return blocks(release)
        if answer == "exit":
            return exits()
        if answer == "interrupt":
            return interrupts()
        if answer == "high":
            return wrong_type()
        return {"none": None, "nan": float("nan")}.get(answer, len(response))
    return reward


def test_a_slow_reward_holds_up_only_its_own_sample(release):
    async def scenario():
        reward = SafeReward(_by_answer(release), pool=ThreadPool(2))
        slow = asyncio.ensure_future(reward.score("x", "block"))
        assert await reward.score("abc", "") == (3.0, None)
        assert not slow.done()  # still blocked, and the loop went on
        release.set()
        assert await slow == (1.0, None)
        reward.close()

    asyncio.run(scenario())


def test_a_reward_blocking_past_its_limit_scores_zero_counted_and_the_next_scores(release):
    async def scenario():
        reward = SafeReward(_by_answer(release), timeout_s=LIMIT, pool=ThreadPool(1))
        value, error = await reward.score("x", "block")
        assert value == 0.0 and error.startswith(
            f"reward function took longer than data.reward_timeout_s={LIMIT}s (its thread "
            "was abandoned")
        assert await reward.score("abcd", "") == (4.0, None)
        assert reward.errors == 1 and reward.reasons == {"timeout": 1}
        reward.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["thread", "inline"])
@pytest.mark.parametrize("answer, error", [
    ("exit", "SystemExit: 3"),
    ("high", "reward function returned str 'high', not a number"),
    ("none", "reward function returned None, not a number"),
    ("nan", "reward function returned nan"),
])
def test_a_reward_that_exits_or_returns_no_number_scores_zero_counted(mode, answer, error):
    async def scenario():
        reward = SafeReward(_by_answer(None), timeout_s=5.0, pool=make_pool(mode, 1))
        assert await reward.score("x", answer) == (0.0, error)
        assert await reward.score("xy", "") == (2.0, None)
        assert reward.errors == 1 and reward.reasons == {"error": 1}
        assert reward.last_errors == [error]
        reward.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_keyboard_interrupt_in_a_reward_stops_the_run(mode):
    reward = SafeReward(_by_answer(None), pool=make_pool(mode, 1))
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(reward.score("x", "interrupt"))
    assert reward.errors == 0
    reward.close()

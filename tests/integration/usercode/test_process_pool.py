"""The user-code pool in worker processes, and what only other processes can show: a worker that
dies (os._exit, a segfault) or hangs costs the calls it held (a UserCodeError: lost, timeout),
its process is replaced (a new pid) and later calls succeed; SystemExit, wrong types and
unpicklable results cost their call only; a fork in user code answers once and its copy ends;
a shared object that does not load in a worker breaks the pool cleanly; closing leaves no
process behind; and a Ctrl-C stops a run whose user code blocks a worker thread.

Integration: every test starts processes."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from usercode_fixtures import (EXPLODES, add, exits, exits_hard, forks, interrupts, pid,
                               remember, reward_by_answer, segfaults, segfaults_in, sleeps,
                               unpicklable_result, wrong_type)

from eddyrl.core.rewarding import SafeReward
from eddyrl.usercode import ProcessPool, UserCodeError, make_pool

pytestmark = pytest.mark.integration

LIMIT = 0.5  # seconds: a call running longer is cut off (after the worker is ready)


def _gone(process_id: int, within_s: float = 30.0) -> bool:
    """Whether the process `process_id` (not ours to reap) ends within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(process_id, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _reaped(child: int, within_s: float = 30.0) -> bool:
    """Whether our child `child` exits within `within_s` (reaping it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        done, _ = os.waitpid(child, os.WNOHANG)
        if done:
            return True
        time.sleep(0.05)
    return False


async def _eventually(condition, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return condition()


async def _failure(pool, fn, *args, timeout_s=LIMIT) -> UserCodeError:
    with pytest.raises(UserCodeError) as error:
        await pool.call(fn, *args, timeout_s=timeout_s)
    return error.value


@pytest.mark.parametrize("fn, died", [(exits_hard, "exited (status 7)"),
                                      (segfaults, "died (SIGSEGV)")],
                         ids=["os._exit", "segfault"])
def test_a_worker_that_dies_loses_its_call_and_is_replaced(fn, died):
    async def scenario():
        with ProcessPool(1) as pool:
            first = await pool.call(pid)
            error = await _failure(pool, fn)
            assert error.reason == "lost"
            assert error.message == f"its worker process {died} and was replaced"
            assert await pool.call(add, 1, 2) == 3
            second = await pool.call(pid)
            assert second != first and pool.replaced == 1
            return first

    assert _gone(asyncio.run(scenario()))


def test_a_worker_that_hangs_is_killed_and_replaced():
    async def scenario():
        with ProcessPool(1) as pool:
            first = await pool.call(pid)
            error = await _failure(pool, sleeps)
            assert error.reason == "timeout" and "killed" in error.message
            assert _gone(first)
            assert await pool.call(add, 2, 2, timeout_s=30) == 4
            assert await pool.call(pid) != first
            assert await _eventually(lambda: pool.replaced == 1)

    asyncio.run(scenario())


@pytest.mark.parametrize("fn, message", [
    (exits, "SystemExit: 3"),
    (unpicklable_result, "its result cannot be sent back"),
])
def test_system_exit_or_an_unpicklable_result_costs_the_call_only(fn, message):
    async def scenario():
        with ProcessPool(1) as pool:
            first = await pool.call(pid)
            error = await _failure(pool, fn, timeout_s=30)
            assert error.reason == "error" and error.message.startswith(message)
            assert await pool.call(pid) == first and pool.replaced == 0  # the same process
            assert await pool.call(wrong_type) == "high"  # types are the caller's to judge

    asyncio.run(scenario())


def test_a_call_that_does_not_pickle_is_refused_before_it_is_sent():
    async def scenario():
        with ProcessPool(1) as pool:
            error = await _failure(pool, lambda: 1)
            assert error.reason == "error" and "cannot be sent" in error.message

    asyncio.run(scenario())


def test_keyboard_interrupt_in_a_worker_process_reaches_the_caller():
    pool = ProcessPool(1)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(pool.call(interrupts))
    pool.close()


@pytest.mark.parametrize("mode", ["process", "thread", "inline"])
def test_a_fork_in_user_code_answers_once_and_its_copy_ends(mode, tmp_path):
    path = str(tmp_path / "child")

    async def scenario():
        with make_pool(mode, 1) as pool:
            assert await pool.call(forks, path) == 1.0  # the original's answer, not the copy's
            assert await pool.call(add, 1, 1) == 2  # and the pool goes on

    asyncio.run(scenario())
    child = int(Path(path).read_text())
    # the copy was forked by the worker process (not ours: it ends) or by this one (reaped)
    assert _gone(child) if mode == "process" else _reaped(child)


def test_a_session_lives_in_one_worker_process_and_is_lost_with_it():
    async def scenario():
        with ProcessPool(2) as pool:
            one, two = pool.session(), pool.session()
            (_, home), (_, other) = await one.call(remember, 1), await two.call(remember, 1)
            assert home != other != os.getpid()  # spread over the workers
            assert await one.call(remember, 2) == (3, home)
            with pytest.raises(UserCodeError) as error:
                await one.call(lambda state: segfaults(), timeout_s=30)
            assert error.value.reason == "error"  # a lambda does not pickle: refused
            with pytest.raises(UserCodeError):
                await one.call(segfaults_in, timeout_s=30)
            with pytest.raises(UserCodeError, match="SIGSEGV") as error:
                await one.call(remember, 1)  # its process is gone, and its state
            assert error.value.reason == "lost"
            assert await two.call(remember, 1) == (2, other)  # the other is untouched
            fresh = pool.session()
            assert (await fresh.call(remember, 1))[0] == 1

    asyncio.run(scenario())


def test_a_shared_object_that_does_not_load_in_a_worker_breaks_the_pool_cleanly():
    async def scenario():
        with ProcessPool(1, shared=EXPLODES) as pool:
            error = await _failure(pool, add, 1, 2, timeout_s=None)
            assert error.reason == "lost" and "worker process could be started" in error.message
            assert "this shared object does not load" in error.message
            error = await _failure(pool, add, 1, 2, timeout_s=None)
            assert error.reason == "lost"

    asyncio.run(scenario())


def test_closing_the_pool_leaves_no_worker_process():
    async def scenario():
        pool = ProcessPool(2)
        await asyncio.gather(pool.call(add, 1, 1), pool.call(add, 2, 2))
        pids = pool.pids
        blocked = asyncio.ensure_future(pool.call(sleeps, timeout_s=30))
        await asyncio.sleep(0.2)
        pool.close()
        with pytest.raises(UserCodeError, match="closed"):
            await blocked
        return pids

    pids = asyncio.run(scenario())
    assert len(pids) == 2 and all(_gone(p) for p in pids)


# --------------------------------------------------------------------- rewards in the pool

@pytest.mark.parametrize("answer, error", [
    ("segfault", "reward worker lost: its worker process died (SIGSEGV) and was replaced"),
    ("exit", "reward worker lost: its worker process exited (status 7) and was replaced"),
    ("sleep", f"reward function took longer than data.reward_timeout_s={LIMIT}s (its worker "
              "process was killed and replaced)"),
])
def test_a_reward_worker_that_dies_or_hangs_scores_zero_and_the_run_goes_on(answer, error):
    async def scenario():
        reward = SafeReward(reward_by_answer, timeout_s=LIMIT, pool=ProcessPool(2))
        assert await reward.score("ab", "") == (2.0, None)
        scores = await asyncio.gather(reward.score("x", answer), reward.score("abc", ""))
        assert scores == [(0.0, error), (3.0, None)]
        assert await reward.score("abcd", "") == (4.0, None)
        reason = "timeout" if answer == "sleep" else "lost"
        assert reward.errors == 1 and reward.reasons == {reason: 1}
        assert await _eventually(lambda: reward.pool.replaced == 1)
        reward.close()

    asyncio.run(scenario())


# --------------------------------------------------------------------------------- Ctrl-C

# The child takes Ctrl-C as a terminal gives it, whatever the test process inherited: a test run
# started in the background by a non-interactive shell ignores SIGINT, and so would the child.
_RUN = textwrap.dedent("""
    import asyncio, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from eddyrl.usercode import make_pool

    async def main():
        pool = make_pool(sys.argv[1], 1)
        blocked = asyncio.ensure_future(pool.call(time.sleep, 60))
        await asyncio.sleep(0.2)
        print("blocked", flush=True)
        await blocked

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
""")


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_one_ctrl_c_stops_a_run_whose_user_code_blocks(mode):
    """Inline, a blocking call holds the event loop, which then never sees the first Ctrl-C;
    off the loop, the first one stops the run."""
    run = subprocess.Popen([sys.executable, "-c", _RUN, mode], stdout=subprocess.PIPE,
                           text=True, cwd=Path(__file__).resolve().parents[3])
    try:
        assert run.stdout.readline().strip() == "blocked"
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=30) == 130
        assert run.stdout.read().strip() == "interrupted"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()

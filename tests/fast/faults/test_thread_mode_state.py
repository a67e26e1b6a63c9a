"""User code in thread mode changing the trainer's process-wide state (issue 32): a reward that
set torch's default dtype changed the trainer's numbers, one that set the umask made every
checkpoint file mode 000. Each change is now put back when the call ends and named in one
warning (`eddyrl/usercode/process_state.py`)."""

import asyncio
import logging
import os
import threading

import pytest
import torch

from eddyrl.usercode import ThreadPool
from eddyrl.process_umask import current_umask
from eddyrl.usercode import process_state

LOGGER = process_state.__name__


def umask() -> int:
    return current_umask()


def float64_reward(text, answer):
    torch.set_default_dtype(torch.float64)
    return float(torch.tensor(1.0).dtype == torch.float64)


def umask_reward(text, answer):
    os.umask(0o777)
    return 1.0


def tidy_reward(text, answer):
    """Changes the dtype and puts it back itself: nothing to say."""
    torch.set_default_dtype(torch.float64)
    torch.set_default_dtype(torch.float32)
    return 1.0


def call(fn, *args):
    with ThreadPool(2, name="reward") as pool:
        return asyncio.run(pool.call(fn, *args, timeout_s=60))


@pytest.fixture
def state(caplog, monkeypatch):
    """A fresh guard (nothing warned yet); the trainer's state as it was, after the test."""
    monkeypatch.setattr(process_state.GUARD, "_warned", set())
    dtype, mask, cwd = torch.get_default_dtype(), umask(), os.getcwd()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        yield caplog
    torch.set_default_dtype(dtype)
    os.umask(mask)
    os.chdir(cwd)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_reward_setting_the_default_dtype_leaves_the_trainers_unchanged(state):
    """Before: torch's default dtype stayed float64 after the call, for the trainer too."""
    before = torch.get_default_dtype()
    assert call(float64_reward, "text", "answer") == 1.0  # the change held during the call
    assert torch.get_default_dtype() == before
    assert call(float64_reward, "text", "answer") == 1.0
    warned = warnings_of(state)
    assert len(warned) == 1, warned  # once per function and what it changed
    assert "float64_reward" in warned[0] and "torch's default dtype" in warned[0] \
        and "restored" in warned[0] and "use process mode" in warned[0], warned


def test_a_reward_setting_the_umask_leaves_checkpoint_files_readable(state, tmp_path):
    """Before: the umask stayed 0777 and every file the trainer wrote next was mode 000."""
    before = umask()
    call(umask_reward, "text", "answer")
    assert umask() == before
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~before
    warned = warnings_of(state)
    assert len(warned) == 1 and "umask_reward" in warned[0] and "the umask" in warned[0] \
        and "0777" in warned[0], warned


def test_an_environment_changing_the_directory_in_a_session_is_put_back(state, tmp_path):
    """Environments run in sessions (`ThreadSession`): the same guard holds there."""
    before = os.getcwd()

    def step(session_state, where):
        os.chdir(where)
        return os.getcwd()

    async def episode():
        with ThreadPool(2, name="environment") as pool:
            session = pool.session()
            try:
                return await session.call(step, str(tmp_path), timeout_s=60)
            finally:
                await session.close(timeout_s=60)

    assert asyncio.run(episode()) == str(tmp_path)
    assert os.getcwd() == before
    assert any("the current directory" in w and "environment code" in w
               for w in warnings_of(state)), warnings_of(state)


def test_a_call_starting_after_anothers_change_does_not_keep_it(state):
    """Two rewards at once: the second starts while the first has float64 set. When the first
    ends, float32 is put back; the second, ending after, must not put float64 back."""
    changed, second_started, first_done = threading.Event(), threading.Event(), \
        threading.Event()

    def first(text, answer):
        torch.set_default_dtype(torch.float64)
        changed.set()
        assert second_started.wait(60)
        return 1.0

    def second(text, answer):
        assert changed.wait(60)
        second_started.set()
        assert first_done.wait(60)
        return 2.0

    async def both():
        with ThreadPool(2, name="reward") as pool:
            a = asyncio.ensure_future(pool.call(first, "t", "a", timeout_s=60))
            b = asyncio.ensure_future(pool.call(second, "t", "a", timeout_s=60))
            await a
            first_done.set()
            return await a, await b

    assert asyncio.run(both()) == (1.0, 2.0)
    assert torch.get_default_dtype() == torch.float32


def test_code_that_changes_nothing_or_tidies_up_is_not_warned_about(state):
    call(tidy_reward, "text", "answer")
    call(lambda text, answer: len(text), "text", "answer")
    assert warnings_of(state) == []

"""Bad reward code: a dotted path that does not load fails at start-up naming the config key; a
reward that raises, returns NaN/inf or a non-number, or hangs, scores 0 for that sample, the
error is recorded and counted (`reward_errors`), and the run goes on. (The
`data.reward_timeout_s` setting reaching a run's reward: test_reward_timeout_setting.py.)"""

import logging
import math
import signal
import threading
import time

import pytest

from eddyrl.core.rewarding import SafeReward, load_reward_fn
from eddyrl.errors import ConfigError


@pytest.mark.parametrize("dotted, problem", [
    pytest.param("eddyrl_no_such_pkg.grader:reward",
                 "module 'eddyrl_no_such_pkg.grader' cannot be imported (ModuleNotFoundError: "
                 "No module named 'eddyrl_no_such_pkg')", id="module-missing"),
    pytest.param("eddyrl.tasks.reward:rewrad",
                 "module 'eddyrl.tasks.reward' has no attribute 'rewrad'", id="attribute-missing"),
    pytest.param("eddyrl.tasks.reward:_WELL_FORMED",
                 "the object is a Pattern, not a callable fn(response_text, answer) -> float",
                 id="not-callable"),
    pytest.param("eddyrl.tasks.reward.reward",
                 "is not a dotted path of the form 'package.module:Name' (nor a file's "
                 "'path/to/file.py:Name')", id="no-colon"),
])
def test_reward_fn_that_does_not_load_names_the_config_key(dotted, problem):
    with pytest.raises(ConfigError) as error:
        load_reward_fn(dotted)
    separator = " " if problem.startswith("is not") else ": "
    assert str(error.value) == f"config key 'data.reward_fn' = {dotted!r}{separator}{problem}"


def fail(message):
    raise ZeroDivisionError(message)


@pytest.mark.parametrize("fn, error", [
    pytest.param(lambda r, a: fail("grader divided by zero"),
                 "ZeroDivisionError: grader divided by zero", id="raises"),
    pytest.param(lambda r, a: float("nan"), "reward function returned nan", id="nan"),
    pytest.param(lambda r, a: -math.inf, "reward function returned -inf", id="inf"),
    pytest.param(lambda r, a: "high", "reward function returned str 'high', not a number",
                 id="not-a-number"),
])
def test_bad_reward_scores_zero_and_is_counted(fn, error):
    reward = SafeReward(fn)
    assert reward("1 2 = 3", "3") == (0.0, error)
    assert reward("1 2 = 3", "3") == (0.0, error)
    assert reward.errors == 2 and reward.last_errors == [error, error]
    assert SafeReward(lambda r, a: 1.0)("x", "y") == (1.0, None)  # a good one is untouched


def sleeps(response, answer):
    time.sleep(30)
    return 1.0


def spins_and_swallows(response, answer):
    """Busy, and catches every Exception: the limit must still cut it off."""
    try:
        while True:
            pass
    except Exception:
        return 1.0


@pytest.mark.parametrize("fn", [sleeps, spins_and_swallows], ids=["sleeps", "spins"])
def test_hanging_reward_is_cut_off_at_reward_timeout_s(fn):
    reward = SafeReward(fn, timeout_s=0.2)
    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's, if it runs
    assert reward("1 2 = 3", "3") == (
        0.0, "reward function took longer than data.reward_timeout_s=0.2s")
    assert reward.errors == 1
    left = signal.getitimer(signal.ITIMER_REAL)[0]  # the reward's own timer is gone
    assert left == 0 if outer == 0 else 0 < left <= outer
    # a quick reward under the same limit scores as usual
    assert SafeReward(lambda r, a: len(r), timeout_s=0.2)("ab", "") == (2.0, None)


def test_hanging_reward_off_the_main_thread_is_cut_off_too():
    reward, out = SafeReward(sleeps, timeout_s=0.2), []
    worker = threading.Thread(target=lambda: out.append(reward("1 2 = 3", "3")))
    worker.start()
    worker.join(10)
    assert out == [(0.0, "reward function took longer than data.reward_timeout_s=0.2s")]
    assert reward.errors == 1


def test_reward_timeout_keeps_an_outer_timer():
    """A test runner's (pytest-timeout's) alarm survives the reward's own."""
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *args: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 50.0)
        assert SafeReward(lambda r, a: 0.5, timeout_s=0.2)("x", "y") == (0.5, None)
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 40 < left <= 50 and signal.getsignal(signal.SIGALRM) is not previous
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


@pytest.mark.parametrize("value, kind", [
    pytest.param("1.0", "str '1.0'", id="text-of-a-number"),
    pytest.param(None, None, id="none"),
    pytest.param([1.0], "list [1.0]", id="list"),
    pytest.param(b"1", "bytes b'1'", id="bytes"),
])
def test_only_real_numbers_count_as_rewards(caplog, value, kind):
    """Text of a number is a bug in the reward function, not a reward: counted, not scored."""
    reward = SafeReward(lambda r, a: value)
    shown = "None" if value is None else kind
    with caplog.at_level(logging.WARNING, logger="eddyrl.core.rewarding"):
        for _ in range(3):
            assert reward("x", "y") == (0.0, f"reward function returned {shown}, not a number")
    assert reward.errors == 3 and reward.reasons == {"error": 3}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1  # once per type, not per sample
    assert warnings[0].startswith(f"reward function returned {type(value).__name__} (")
    assert warnings[0].endswith("not a number: scored 0 and counted in reward_errors (a reward "
                                "must be an int, float, bool or numpy number)")


def test_numbers_of_every_kind_count():
    np = pytest.importorskip("numpy")
    import torch

    for value, score in [(1, 1.0), (0.5, 0.5), (True, 1.0), (False, 0.0),
                         (np.float32(0.25), 0.25), (np.int64(2), 2.0), (np.float64(-1), -1.0),
                         (torch.tensor(0.75), 0.75)]:
        assert SafeReward(lambda r, a: value)("x", "y") == (score, None), value


def test_a_reward_that_always_raises_says_so_once_with_its_error(caplog):
    """Issue 32: `data.reward_fn=os:getcwd` (called with two arguments, it always raises) was
    silent: accuracy 0 -> 0, the error nowhere. Its first error, type and message, is now a
    warning when it happens (once: later ones are counted, not logged) and kept for the run's
    summary and last line."""
    reward = SafeReward(load_reward_fn("os:getcwd"))
    with caplog.at_level(logging.WARNING, logger="eddyrl.core.rewarding"):
        for _ in range(3):
            assert reward("x", "y")[0] == 0.0
    error = "TypeError: posix.getcwd() takes no arguments (2 given)"
    assert reward.errors == 3 and reward.first_error == error
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"reward function failed: {error}; the sample scored 0 and is counted "
                        "in reward_errors (warned once: later failures are only counted)"]


def test_reward_errors_end_the_run_s_output_with_the_first_one(monkeypatch, tmp_path, capsys):
    """Issue 32: the run's last lines said "held-out accuracy: 0.000 -> 0.000" and nothing of
    the reward errors counted in its summary; now one line gives their count and the first."""
    import json

    import eddyrl.launch
    from eddyrl.cli import main

    def train(config, on_step):  # what a run whose every reward raised leaves in summary.json
        path = tmp_path / "summary.json"
        path.write_text(json.dumps({
            "initial_eval_accuracy": 0.0, "final_eval_accuracy": 0.0, "wall_seconds": 3.0,
            "steps": 2, "reward_errors": 32, "reward_first_error": "TypeError: boom"}))
        return path

    monkeypatch.setattr(eddyrl.launch, "train", train)
    assert main(["train", f"run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "reward errors: 32 samples scored 0 (the first: TypeError: boom)" in out, out

"""Calling a user's reward function safely: a failure costs one sample, never the run.

`SafeReward.score`, the rollout's entry point, runs the reward in the run's user-code pool
(`user_code.reward`: worker threads by default, or worker processes; `eddyrl.usercode`), so a
slow or blocking reward holds up only the samples it scores, and the limit is kept there. With
no pool (the simulator, tests) or an inline one it calls the reward on the caller's thread, as
the plain call `reward(response, answer)` always does: in the main thread a SIGALRM cuts it off
at the limit.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ..plugins import load_reward_fn  # noqa: F401  (where callers load data.reward_fn from)
from ..usercode.pool import Pool, UserCodeError

RewardFn = Callable[[str, str], float]

log = logging.getLogger(__name__)


class RewardTimeout(BaseException):
    """A reward call ran past its limit. A BaseException, so that a reward's own `except
    Exception` cannot swallow it (math-verify's timeout is one for the same reason)."""


@dataclass
class SafeReward:
    """Wraps a reward function: an exception (SystemExit included), a value that is not a
    finite real number (text such as "1.0" and None included: `_check`), a call longer than
    `timeout_s` (`data.reward_timeout_s`; None: no limit) or, in a process pool, a worker
    that dies under it gives reward 0; the error is recorded on the sample and counted
    (`errors`, and `reasons` by why: error, timeout, lost), and the run goes on. The first
    failure of each kind is logged as a warning when it happens, its text kept (`first_error`,
    in the run's summary and end line): a reward that always fails is not silent. A
    KeyboardInterrupt is raised on: it stops the run."""

    fn: RewardFn
    timeout_s: float | None = None
    errors: int = 0
    last_errors: list[str] = field(default_factory=list)
    # where `score` runs the reward (`user_code.reward`); None: on the caller's thread
    pool: Pool | None = None
    reasons: Counter = field(default_factory=Counter)
    # the types of non-number rewards warned about (one warning each)
    _warned_types: set[str] = field(default_factory=set, init=False, repr=False)
    # the first failure's text, and the kinds (`reasons`) already warned about
    first_error: str | None = field(default=None, init=False)
    _warned_reasons: set[str] = field(default_factory=set, init=False, repr=False)

    def __call__(self, response: str, answer: str) -> tuple[float, str | None]:
        """Score on this thread (never the pool's)."""
        pid = os.getpid()
        try:
            value = self._call(response, answer)
        except RewardTimeout:
            return self._fail(self._too_long(), "timeout")
        except (Exception, SystemExit) as exc:  # user code: its failure is this sample's
            return self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            if os.getpid() != pid:  # a fork in the reward: the copy must not score on
                os._exit(0)
        return self._check(value)

    async def score(self, response: str, answer: str) -> tuple[float, str | None]:
        """The rollout's entry point: score one response in the pool (off the event loop
        unless the pool is inline), the limit kept there."""
        if self.pool is None or self.pool.mode == "inline":
            return self(response, answer)
        try:
            value = await self.pool.call(self.fn, response, answer, timeout_s=self.timeout_s)
        except UserCodeError as exc:
            if exc.reason == "timeout":
                return self._fail(f"{self._too_long()} ({exc.message})", "timeout")
            if exc.reason == "lost":
                return self._fail(f"reward worker lost: {exc.message}", "lost")
            return self._fail(exc.message)
        return self._check(value)

    def close(self) -> None:
        """Stop the pool's workers (the run is over)."""
        if self.pool is not None:
            self.pool.close()

    def _call(self, response: str, answer: str) -> float:
        if self.timeout_s is None:
            return self.fn(response, answer)
        if threading.current_thread() is threading.main_thread() and \
                hasattr(signal, "SIGALRM"):
            return _with_alarm(self.fn, (response, answer), self.timeout_s)
        return _with_thread(self.fn, (response, answer), self.timeout_s)

    def _check(self, value: object) -> tuple[float, str | None]:
        """A reward is a real number: int, float, bool (True is 1.0), a numpy number or a
        one-element tensor or array (anything with `__float__`). Text is not, even text of a
        number ("1.0": the reward function has a bug); neither is None. Those are counted
        errors, with one warning per type."""
        if isinstance(value, (str, bytes, bytearray)) or \
                not hasattr(type(value), "__float__"):
            kind = type(value).__name__
            if kind not in self._warned_types:
                self._warned_types.add(kind)
                log.warning("reward function returned %s (%.60r), not a number: scored 0 and "
                            "counted in reward_errors (a reward must be an int, float, bool or "
                            "numpy number)", kind, value)
            shown = "None" if value is None else f"{kind} {value!r:.60}"
            return self._fail(f"reward function returned {shown}, not a number", warn=False)
        try:
            value = float(value)  # type: ignore[arg-type]
        except Exception as exc:  # a tensor of many values...
            return self._fail(f"{type(exc).__name__}: {exc}")
        if not math.isfinite(value):
            return self._fail(f"reward function returned {value}")
        return value, None

    def _too_long(self) -> str:
        return f"reward function took longer than data.reward_timeout_s={self.timeout_s}s"

    def _fail(self, message: str, reason: str = "error", warn: bool = True
              ) -> tuple[float, None | str]:
        """Score 0 and count it; the first failure of its kind is also a warning (`warn`
        False: the caller has given a better one)."""
        self.errors += 1
        self.reasons[reason] += 1
        self.first_error = self.first_error or message
        if warn and reason not in self._warned_reasons:
            self._warned_reasons.add(reason)
            log.warning("reward function failed: %s; the sample scored 0 and is counted in "
                        "reward_errors (warned once: later failures are only counted)", message)
        self.last_errors = (self.last_errors + [message])[-5:]
        return 0.0, message


def _raise_timeout(signum, frame) -> None:
    raise RewardTimeout


def _with_alarm(fn: RewardFn, args: tuple, timeout_s: float) -> float:
    """`fn(*args)` cut off by SIGALRM after `timeout_s` (the controller scores in the main
    thread): the Python code is interrupted, nothing keeps running. Another timer already set
    (a test runner's) is put back afterwards, less the time spent; a reward that sets its own
    alarm (math-verify does, in the main thread) replaces this limit from then on, and bounds
    itself."""
    handler = signal.signal(signal.SIGALRM, _raise_timeout)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        try:
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:  # also when the alarm went off just as the call returned
        signal.signal(signal.SIGALRM, handler if handler is not None else signal.SIG_DFL)
        if outer_delay:
            left = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def _with_thread(fn: RewardFn, args: tuple, timeout_s: float) -> float:
    """`fn(*args)` in a daemon thread, waited for `timeout_s`: off the main thread no signal
    can interrupt it, so a call that runs over is abandoned (Python cannot stop a thread)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="reward", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]

"""Calling a user's reward function safely: a failure costs one sample, never the run.

`SafeReward.score`, the rollout's entry point, runs the reward in the run's user-code pool
(`user_code.reward`: worker threads by default, or worker processes; `eddyrl.usercode`), so a
slow or blocking reward holds up only the samples it scores, and the limit is kept there. With
no pool (the simulator, tests) or an inline one it calls the reward on the caller's thread, as
the plain call `reward(response, answer)` always does: in the main thread a SIGALRM cuts it off
at the limit.

Several rewards (`data.rewards`) are one `WeightedRewards`: a reward function itself, giving
sum(weight_i * r_i), which is what environments call. `SafeReward` scores its terms one by one,
each guarded and limited on its own, and reports each term's value beside the sum (`Scored`),
for the step metrics (`reward/<name>`), the samples and the evaluation. One reward function is
the one-term case: weight 1.0 and no name, so the sum is its value and nothing more is logged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

from ..plugins import load_reward_fn
from ..usercode.pool import Pool, UserCodeError

RewardFn = Callable[[str, str], float]


@dataclass(frozen=True, slots=True)
class RewardTerm:
    """One reward of the run's sum. `name`: what its metrics are logged under (None: the run's
    only reward, `data.reward_fn`, logged as the combined reward and nothing more)."""

    fn: RewardFn
    weight: float = 1.0
    name: str | None = None


@dataclass(frozen=True, slots=True)
class WeightedRewards:
    """`data.rewards`: the reward sum(weight_i * fn_i(response, answer)). A reward function
    in its own right (a bundled environment scores an episode's final answer with it);
    it pickles by reference to its terms' functions, as a process pool needs."""

    terms: tuple[RewardTerm, ...]

    def __call__(self, response: str, answer: str) -> float:
        return weighted_sum(self.terms, [float(t.fn(response, answer)) for t in self.terms])


class Scored(NamedTuple):
    """A response's reward (the weighted sum), the error of a failed reward call (None: none
    failed) and each named term's own, unweighted value (None: one unnamed reward)."""

    reward: float
    error: str | None
    parts: dict[str, float] | None


class RewardEntry(Protocol):  # tasks.config.RewardSpec: a checked entry of `data.rewards`
    fn: str
    weight: float
    name: str


def load_reward(reward_fn: str, rewards: Sequence[RewardEntry] = ()) -> RewardFn:
    """The run's reward: `data.rewards` loaded and summed (`WeightedRewards`) when given, else
    the one function `data.reward_fn` names. ConfigError naming the key on a problem."""
    if not rewards:
        return load_reward_fn(reward_fn)
    return WeightedRewards(tuple(
        RewardTerm(load_reward_fn(entry.fn, f"data.rewards[{index}].fn"), entry.weight,
                   entry.name) for index, entry in enumerate(rewards)))


def weighted_sum(terms: Sequence[RewardTerm], values: Sequence[float]) -> float:
    """sum(weight * value); one term of weight 1.0 gives its value exactly (-0.0 included)."""
    total = terms[0].weight * values[0]
    for term, value in zip(terms[1:], values[1:]):
        total += term.weight * value
    return total

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
    KeyboardInterrupt is raised on: it stops the run.

    `fn` is one reward function or a `WeightedRewards`, whose terms are each called, limited
    and checked on their own: a failed call scores its term 0 in the sum and counts once in
    `errors`, its message naming the term."""

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
    # what is called: `fn`'s terms, or `fn` as the one unnamed term
    terms: tuple[RewardTerm, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.terms = self.fn.terms if isinstance(self.fn, WeightedRewards) \
            else (RewardTerm(self.fn),)

    def __call__(self, response: str, answer: str) -> tuple[float, str | None]:
        """Score on this thread (never the pool's)."""
        return self._sum([self._guarded(t, response, answer) for t in self.terms])[:2]

    async def score(self, response: str, answer: str) -> tuple[float, str | None]:
        """The reward and the error of `score_parts`."""
        return (await self.score_parts(response, answer))[:2]

    async def score_parts(self, response: str, answer: str) -> Scored:
        """The rollout's entry point: score one response in the pool (off the event loop
        unless the pool is inline), the limit kept there; several terms side by side."""
        if self.pool is None or self.pool.mode == "inline":
            return self._sum([self._guarded(t, response, answer) for t in self.terms])
        return self._sum(await asyncio.gather(*(self._in_pool(t, response, answer)
                                                for t in self.terms)))

    def close(self) -> None:
        """Stop the pool's workers (the run is over)."""
        if self.pool is not None:
            self.pool.close()

    def _sum(self, results: Sequence[tuple[float, str | None]]) -> Scored:
        values = [value for value, _ in results]
        errors = [error for _, error in results if error is not None]
        parts = None if self.terms[0].name is None else \
            {term.name: value for term, value in zip(self.terms, values)}
        return Scored(weighted_sum(self.terms, values), "; ".join(errors) or None, parts)

    def _guarded(self, term: RewardTerm, response: str, answer: str
                 ) -> tuple[float, str | None]:
        """One term's value on this thread, or 0 and the error."""
        pid = os.getpid()
        try:
            value = self._call(term.fn, response, answer)
        except RewardTimeout:
            return self._fail(term, self._too_long(), "timeout")
        except (Exception, SystemExit) as exc:  # user code: its failure is this sample's
            return self._fail(term, f"{type(exc).__name__}: {exc}")
        finally:
            if os.getpid() != pid:  # a fork in the reward: the copy must not score on
                os._exit(0)
        return self._check(term, value)

    async def _in_pool(self, term: RewardTerm, response: str, answer: str
                       ) -> tuple[float, str | None]:
        """One term's value from the pool, or 0 and the error."""
        try:
            value = await self.pool.call(term.fn, response, answer, timeout_s=self.timeout_s)
        except UserCodeError as exc:
            if exc.reason == "timeout":
                return self._fail(term, f"{self._too_long()} ({exc.message})", "timeout")
            if exc.reason == "lost":
                return self._fail(term, f"reward worker lost: {exc.message}", "lost")
            return self._fail(term, exc.message)
        return self._check(term, value)

    def _call(self, fn: RewardFn, response: str, answer: str) -> float:
        if self.timeout_s is None:
            return fn(response, answer)
        if threading.current_thread() is threading.main_thread() and \
                hasattr(signal, "SIGALRM"):
            return _with_alarm(fn, (response, answer), self.timeout_s)
        return _with_thread(fn, (response, answer), self.timeout_s)

    def _check(self, term: RewardTerm, value: object) -> tuple[float, str | None]:
        """A reward is a real number: int, float, bool (True is 1.0), a numpy number or a
        one-element tensor or array (anything with `__float__`). Text is not, even text of a
        number ("1.0": the reward function has a bug); neither is None. Those are counted
        errors, with one warning per type."""
        if isinstance(value, (str, bytes, bytearray)) or \
                not hasattr(type(value), "__float__"):
            kind = type(value).__name__
            if kind not in self._warned_types:
                self._warned_types.add(kind)
                log.warning("reward function%s returned %s (%.60r), not a number: scored 0 and "
                            "counted in reward_errors (a reward must be an int, float, bool or "
                            "numpy number)", _named(term, " {!r}"), kind, value)
            shown = "None" if value is None else f"{kind} {value!r:.60}"
            return self._fail(term, f"reward function returned {shown}, not a number",
                              warn=False)
        try:
            value = float(value)  # type: ignore[arg-type]
        except Exception as exc:  # a tensor of many values...
            return self._fail(term, f"{type(exc).__name__}: {exc}")
        if not math.isfinite(value):
            return self._fail(term, f"reward function returned {value}")
        return value, None

    def _too_long(self) -> str:
        return f"reward function took longer than data.reward_timeout_s={self.timeout_s}s"

    def _fail(self, term: RewardTerm, message: str, reason: str = "error", warn: bool = True
              ) -> tuple[float, None | str]:
        """Score 0 and count it; the first failure of its kind is also a warning (`warn`
        False: the caller has given a better one). A named term's message names it."""
        message = _named(term, "reward {!r}: ") + message
        self.errors += 1
        self.reasons[reason] += 1
        self.first_error = self.first_error or message
        if warn and reason not in self._warned_reasons:
            self._warned_reasons.add(reason)
            log.warning("reward function failed: %s; the sample scored 0 and is counted in "
                        "reward_errors (warned once: later failures are only counted)", message)
        self.last_errors = (self.last_errors + [message])[-5:]
        return 0.0, message


def _named(term: RewardTerm, form: str) -> str:
    """`form` with the term's name in it; "" for the unnamed one."""
    return "" if term.name is None else form.format(term.name)


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

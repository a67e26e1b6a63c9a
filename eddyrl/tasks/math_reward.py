"""Reward for math answers, checked with math-verify: 1.0 when the response's final answer is
mathematically equal to the gold answer (so 0.5, 1/2 and \\frac{1}{2} all match), else 0.0.

Select it with `data.reward_fn=eddyrl.tasks.math_reward:reward`. It needs the `math-verify`
package (`pip install 'eddyrl[data]'`); importing this module only checks that it is there, so
a missing package fails when the config's reward is loaded, and math-verify itself (sympy,
antlr) is imported on the first call.

The final answer is, in this order of preference:
1. the content of the last closed `\\boxed{...}` (or `\\fbox{...}`),
2. else the text after the last `Answer:` (DAPO-Math's prompts ask for that last line),
3. else the text after the last `####` (GSM8K's solutions end that way).
A response with none of these earns 0.0.

Never raises on any response or answer (0.0 instead), and bounded in time: answers longer than
MAX_ANSWER_CHARS are refused before parsing, and in the main thread math-verify's own timeouts
(`parse(..., parsing_timeout=)`, `verify(..., timeout_seconds=)`, which use SIGALRM) cut off a
slow parse or comparison. SIGALRM works only in a main thread: rewards run in the
`user_code.reward` pool, on worker threads by default, where these timeouts are off and only
the length cap and the pool's `data.reward_timeout_s` apply (a timed-out thread is abandoned,
not stopped). The math recipes set `user_code.reward.mode: process`: each worker process runs
the reward in its main thread, so math-verify's timeouts work, and the pool kills a worker
that runs past `data.reward_timeout_s`.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import threading

if importlib.util.find_spec("math_verify") is None:
    raise ImportError("eddyrl.tasks.math_reward needs the math-verify package: "
                      "pip install 'eddyrl[data]' (or pip install math-verify)")

PARSE_TIMEOUT_S = 1  # math-verify's timeouts are whole seconds (signal.alarm); real answers
VERIFY_TIMEOUT_S = 2  # parse in milliseconds, so a sample costs at most about 1 + 2 s
MAX_ANSWER_CHARS = 1000  # no real final answer is longer; longer ones are not parsed
_PLAIN_MAX_CHARS = 100  # longer answers are not parsed a second time as plain text
_MAX_BOXED_TRIES = 16  # unclosed \boxed{ (a cut-off response) tried before giving up

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_LINE = re.compile(r"Answer\s*:[ \t]*([^\n]*)")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_UNIT_TAIL = re.compile(r"^([^\\a-zA-Z]*\d)\s+[a-zA-Z][a-zA-Z .]*$")


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the `}` closing the group that opens just before `start`, within
    MAX_ANSWER_CHARS; None when it is not closed there."""
    depth = 1
    for index in range(start, min(len(text), start + MAX_ANSWER_CHARS + 1)):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last closed `\\boxed{...}` in `text`, or None."""
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches[-_MAX_BOXED_TRIES:]):
        end = _closing_brace(text, match.end())
        if end is not None:
            return text[match.end():end]
    return None


def final_answer(response: str) -> str | None:
    """The final answer stated in a response, or None when it states none."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_ANSWER_LINE, _HASHES):
        found = None
        for found in pattern.finditer(response):
            pass
        if found is not None:
            return found.group(1).strip()
    return None


@functools.cache
def _math_verify():
    import math_verify

    return math_verify


def _timeouts() -> tuple[int | None, int | None]:
    if threading.current_thread() is threading.main_thread():
        return PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S
    return None, None  # SIGALRM cannot be set here; the length cap bounds the work


def _parse(text: str) -> list:
    """math-verify's parse of an answer, read as the content of a \\boxed{} (so "2\\sqrt{2}",
    "(1,2)" and "x^2+1" parse whole), else as plain text when that finds no expression ("$18"
    is 18). A number followed by plain words ("18 dollars") is read as the number."""
    if len(text) > MAX_ANSWER_CHARS:
        return []
    text = _UNIT_TAIL.sub(r"\1", text.strip().rstrip(".").strip())
    if not text:
        return []
    mv, timeout = _math_verify(), _timeouts()[0]
    parsed = mv.parse("\\boxed{" + text + "}", parsing_timeout=timeout)
    if len(text) <= _PLAIN_MAX_CHARS and not any(not isinstance(x, str) for x in parsed):
        parsed = mv.parse(text, parsing_timeout=timeout) or parsed
    return parsed


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    return tuple(_parse(answer))  # every sample of a group shares the gold


def reward(response: str, answer: str) -> float:
    """1.0 when the final answer of `response` equals the gold `answer`, else 0.0."""
    try:
        found = final_answer(response)
        if found is None:
            return 0.0
        gold = list(_parse_gold(answer))
        predicted = _parse(found)
        if not gold or not predicted:
            return 0.0
        same = _math_verify().verify(gold, predicted, timeout_seconds=_timeouts()[1])
        return 1.0 if same else 0.0
    except Exception:  # a reward is a sample's score: bad input scores 0, never stops the run
        return 0.0
    except BaseException as exc:  # math-verify's TimeoutException is a BaseException
        if isinstance(exc, _math_verify().errors.TimeoutException):
            return 0.0
        raise

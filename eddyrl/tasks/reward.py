"""Reward for the arith task: is the number after the last `=` the right sum?"""

from __future__ import annotations

import re

# The whole response must be running sums then `= total`; anything else earns no format credit.
_WELL_FORMED = re.compile(r"\d+( \d+)* = \d+")
_FINAL_ANSWER = re.compile(r"=\s*(-?\d+)\s*$")


def extract_answer(response_text: str) -> str | None:
    """The integer after the final `=`, or None when the response does not end with one."""
    match = _FINAL_ANSWER.search(response_text.strip())
    return str(int(match.group(1))) if match else None


def reward(response_text: str, answer: str, format_weight: float = 0.0) -> float:
    """1.0 for the correct final answer; otherwise `format_weight` if well formed, else 0."""
    if extract_answer(response_text) == answer.strip():
        return 1.0
    if format_weight and _WELL_FORMED.fullmatch(response_text.strip()):
        return format_weight
    return 0.0

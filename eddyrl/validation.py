"""Small checks each config section uses to validate itself with messages that name the key,
the bad value and what is allowed."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

from .errors import ConfigError


def did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        # YAML 1.1 reads off/on/no/yes as booleans, which a string field receives as text
        boolean = " (YAML read a bare off/on/no/yes as a boolean)" \
            if str(value) in ("True", "False") else ""
        raise ConfigError(f"config key {key!r} = {value!r}{boolean} is not allowed; choose one "
                          f"of {', '.join(map(repr, allowed))}"
                          f"{did_you_mean(str(value), allowed)}")


def check_range(key: str, value: float, lo: float | None = None, hi: float | None = None,
                *, lo_open: bool = False, hi_open: bool = False) -> None:
    bad = ((lo is not None and (value < lo or (lo_open and value == lo)))
           or (hi is not None and (value > hi or (hi_open and value == hi))))
    if bad:
        left = "(-inf" if lo is None else f"{'(' if lo_open else '['}{lo}"
        right = "inf)" if hi is None else f"{hi}{')' if hi_open else ']'}"
        raise ConfigError(f"config key {key!r} = {value!r} is out of range; allowed: "
                          f"{left}, {right}")


def check_positive(key: str, value: float) -> None:
    check_range(key, value, 0, None, lo_open=True)


def contradiction(message: str) -> ConfigError:
    return ConfigError(f"contradictory settings: {message}")

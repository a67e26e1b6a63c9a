"""Small checks each config section uses to validate itself with messages that name the key,
the bad value and what is allowed.

Every float of the config tree is checked for being finite before any section's own checks
(`check_finite_fields`, called by the root's `validate`): NaN compares false with every bound,
so a range check alone would let it through, and an infinite learning rate or timeout is never
meant. A key where inf has a meaning declares it on its field (`inf_allowed`) and in its range
check (`check_range(..., allow_inf=True)`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Iterable

from .errors import ConfigError

# Field metadata key of a float field that takes +/-inf (its value: what inf means there).
ALLOW_INF = "eddy_allow_inf"


def inf_allowed(default: float, meaning: str) -> Any:
    """A dataclass field (default `default`) whose value may be infinite: `meaning` says what
    inf means there (e.g. "no limit"). Every other float field of the config must be finite."""
    return dataclasses.field(default=default, metadata={ALLOW_INF: meaning})


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


def check_finite(key: str, value: Any, allow_inf: str | bool = False) -> None:
    """ConfigError naming `key` when `value` (a number) is NaN, or infinite where that is not
    allowed (`allow_inf`: truthy, or the meaning of inf there)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if math.isnan(value):
        also = f" (or inf: {allow_inf})" if isinstance(allow_inf, str) and allow_inf else ""
        raise ConfigError(f"config key {key!r} = nan is not a number; give a finite "
                          f"value{also}")
    if math.isinf(value) and not allow_inf:
        raise ConfigError(f"config key {key!r} = {value!r} is not a finite number; give a "
                          "finite value")


def check_finite_fields(config: Any, prefix: str = "") -> None:
    """`check_finite` on every number of a config tree of dataclasses (sections, and lists of
    dataclasses such as `routing.buckets`), with `inf_allowed` fields taking inf. Free-form
    mappings (`env.options`) are their owners' to check."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_finite_fields(value, key + ".")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_finite_fields(item, f"{key}[{index}].")
                else:
                    check_finite(f"{key}[{index}]", item, f.metadata.get(ALLOW_INF, False))
        else:
            check_finite(key, value, f.metadata.get(ALLOW_INF, False))


def check_range(key: str, value: float, lo: float | None = None, hi: float | None = None,
                *, lo_open: bool = False, hi_open: bool = False,
                allow_inf: bool = False) -> None:
    """`value` within [lo, hi] (open ends as said; None: unbounded). NaN is always refused (it
    compares false with every bound), +/-inf unless `allow_inf` (and then only within the
    bounds: a lower bound still refuses -inf)."""
    check_finite(key, value, allow_inf)
    bad = ((lo is not None and (value < lo or (lo_open and value == lo)))
           or (hi is not None and (value > hi or (hi_open and value == hi))))
    if bad:
        left = "(-inf" if lo is None else f"{'(' if lo_open else '['}{lo}"
        right = ("inf]" if allow_inf else "inf)") if hi is None else \
            f"{hi}{')' if hi_open else ']'}"
        raise ConfigError(f"config key {key!r} = {value!r} is out of range; allowed: "
                          f"{left}, {right}")


# The lowest sampling temperature above 0 (greedy). Sampler and trainer divide fp32 logits by
# it: at 1e-45 every logit is inf, the softmax NaN, and sampling raised. vLLM raises any
# temperature below 0.01 to 0.01 (its sampling_params._MAX_TEMP, with a log line), which
# would leave the trainer dividing by another temperature than the sampler's; at 0.01 a logit
# overflows fp32 only past 3e36, and the trainer's gradients grow at most 100-fold.
MIN_TEMPERATURE = 0.01


def check_temperature(key: str, value: float, *, greedy: str | None = None) -> None:
    """`value` is 0 or at least `MIN_TEMPERATURE`; `greedy`: why 0 is refused here (None:
    0 means greedy and is allowed)."""
    check_range(key, value, 0)
    if value == 0 and greedy is not None:
        raise ConfigError(f"config key {key!r} = {value!r}: {greedy}")
    if 0 < value < MIN_TEMPERATURE:
        raise ConfigError(
            f"config key {key!r} = {value!r} is below {MIN_TEMPERATURE}, the lowest sampling "
            "temperature: logits divided by it overflow (inf, then NaN probabilities), and "
            f"vLLM raises it to {MIN_TEMPERATURE}, away from what the trainer divides by; use "
            + ("" if greedy is not None else "0 for greedy or ") + f"at least {MIN_TEMPERATURE}")


def check_positive(key: str, value: float) -> None:
    check_range(key, value, 0, None, lo_open=True)


def contradiction(message: str) -> ConfigError:
    return ConfigError(f"contradictory settings: {message}")

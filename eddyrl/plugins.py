"""Extension points named in config by dotted path, `package.module:Name` (a reward function,
an environment), loaded in one place so that every one fails the same way: at start-up, with
a ConfigError naming the config key, the dotted path and what is wrong (not a dotted path,
module cannot be imported, attribute missing, not callable)."""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable

from .errors import ConfigError

_DOTTED = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
REWARD_FN = "a callable fn(response_text, answer) -> float"


def load_dotted(dotted: str, key: str, *, expect: str | None = None) -> Any:
    """The object `package.module:Name` names (`Name` may be `Outer.Inner`). With `expect`
    (what the caller needs, in words: "a callable fn(...)"), the object must be callable."""
    where = f"config key {key!r} = {dotted!r}"
    if not isinstance(dotted, str) or not _DOTTED.fullmatch(dotted):
        raise ConfigError(f"{where} is not a dotted path of the form 'package.module:Name'")
    module_name, _, attr = dotted.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ModuleNotFoundError, or the module's own import failing
        raise ConfigError(f"{where}: module {module_name!r} cannot be imported "
                          f"({type(exc).__name__}: {exc})") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if expect is not None and not callable(target):
        raise ConfigError(f"{where}: the object is a {type(target).__name__}, not {expect}")
    return target


def load_reward_fn(dotted: str, key: str = "data.reward_fn") -> Callable[[str, str], float]:
    """The reward function `dotted` names: `fn(response_text, answer) -> float`."""
    return load_dotted(dotted, key, expect=REWARD_FN)

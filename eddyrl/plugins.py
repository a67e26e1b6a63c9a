"""Extension points named in config by dotted path, `package.module:Name`, or by a Python
file's path, `path/to/file.py:Name` (a reward function, an environment), loaded in one place so
that every one fails the same way: at start-up, with a ConfigError naming the config key, the
path and what is wrong (not a dotted path, module cannot be imported, file missing, attribute
missing, not callable).

A file is imported as the module its name makes (`./myreward.py` -> `myreward`) with its folder
put first on `sys.path`: so the function pickles by reference to that name, and the user-code
worker processes (which take the controller's `sys.path`: usercode/child.py) import it the same
way. A module of that name that already comes from elsewhere is refused rather than shadowed.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError

_NAME = r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*"
_DOTTED = re.compile(rf"{_NAME}:{_NAME}")
_FILE = re.compile(rf"(?P<file>.+\.py):(?P<attr>{_NAME})")
REWARD_FN = "a callable fn(response_text, answer) -> float"


def load_dotted(dotted: str, key: str, *, expect: str | None = None) -> Any:
    """The object `package.module:Name` names (`Name` may be `Outer.Inner`). With `expect`
    (what the caller needs, in words: "a callable fn(...)"), the object must be callable."""
    where = f"config key {key!r} = {dotted!r}"
    in_file = _FILE.fullmatch(dotted) if isinstance(dotted, str) else None
    if in_file is not None:
        module_name, attr = _file_module(in_file["file"], where), in_file["attr"]
    elif isinstance(dotted, str) and _DOTTED.fullmatch(dotted):
        module_name, _, attr = dotted.partition(":")
    else:
        raise ConfigError(f"{where} is not a dotted path of the form 'package.module:Name' "
                          "(nor a file's 'path/to/file.py:Name')")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ModuleNotFoundError, or the module's own import failing
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and in_file is None and \
                exc.name == module_name.split(".")[0] and Path(f"{module_name}.py").is_file():
            hint = (f"; '{module_name}.py' is in the current directory, which `eddy` does not "
                    f"import from: name the file, {key}=./{module_name}.py:{attr}")
        raise ConfigError(f"{where}: module {module_name!r} cannot be imported "
                          f"({type(exc).__name__}: {exc}){hint}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if expect is not None and not callable(target):
        raise ConfigError(f"{where}: the object is a {type(target).__name__}, not {expect}")
    return target


def _file_module(file: str, where: str) -> str:
    """The module name a Python file is imported as, its folder first on sys.path."""
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{where}: no such file '{path}'")
    name = path.stem
    if not name.isidentifier():
        raise ConfigError(f"{where}: '{path.name}' cannot be imported as a module (its name "
                          "must be a Python identifier: letters, digits, underscores)")
    loaded = sys.modules.get(name)
    origin = getattr(loaded, "__file__", None) if loaded is not None else None
    if loaded is None:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
    if origin is not None and Path(origin).resolve() != path:
        raise ConfigError(f"{where}: a module named {name!r} already comes from '{origin}', "
                          f"which '{path}' would shadow; rename the file")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return name


def load_reward_fn(dotted: str, key: str = "data.reward_fn") -> Callable[[str, str], float]:
    """The reward function `dotted` names: `fn(response_text, answer) -> float`."""
    return load_dotted(dotted, key, expect=REWARD_FN)

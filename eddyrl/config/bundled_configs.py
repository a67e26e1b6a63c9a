"""The config files shipped inside the package (`eddyrl/configs/`), found by name.

A bundled config is named by its path under `eddyrl/configs/` without `.yaml`:
`tiny_cpu`, `tool_add_tiny`, `modes/replay`, `recipes/qwen3_4b_dapo_math_gpu`, `sim/dora_64`.
The files are package data, located with `importlib.resources`, so a name works the same from
a source checkout and from an installed wheel. Wherever a command takes a config file, a file
that exists wins over a bundled name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import ConfigError
from ..validation import did_you_mean

SUFFIX = ".yaml"


def bundled_root() -> Path:
    """The folder that holds the bundled configs."""
    root = resources.files("eddyrl") / "configs"
    if not isinstance(root, Path):  # a zipped install: the configs must be plain files
        raise ConfigError(f"the bundled configs are not plain files ({root!r}); install eddyrl "
                          "unzipped")
    return root


def bundled_names(folder: str | None = None) -> list[str]:
    """Every bundled config's name, sorted; under `folder` (e.g. "sim") relative to it."""
    root = bundled_root()
    base = root / folder if folder else root
    if not base.is_dir():
        return []
    return sorted(p.relative_to(base).with_suffix("").as_posix()
                  for p in base.rglob(f"*{SUFFIX}"))


def _normal(name: str) -> str:
    name = str(name).replace("\\", "/").strip("/")
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name


def find_bundled(name: str, folder: str | None = None) -> Path | None:
    """The bundled config called `name` (or `folder/name`), or None."""
    root = bundled_root()
    name = _normal(name)
    for candidate in (f"{folder}/{name}" if folder else None, name):
        if candidate and ".." not in candidate.split("/"):
            path = root / f"{candidate}{SUFFIX}"
            if path.is_file():
                return path
    return None


def _unknown(name: str, folder: str | None) -> ConfigError:
    names = bundled_names(folder)
    given = _normal(name)
    plain = given
    if plain.startswith("configs/"):  # the folder's old place at the top of the repository
        plain = plain[len("configs/"):]
        if folder and plain.startswith(f"{folder}/"):
            plain = plain[len(folder) + 1:]
    hint = did_you_mean(plain, names)
    if folder:
        kind = {"sim": "scenario"}.get(folder, f"{folder} config")
        return ConfigError(f"no {kind} file {name!r} and no bundled {kind} {given!r}{hint} "
                           f"({kind}s: {names})")
    return ConfigError(f"config file '{name}' does not exist, nor is it a bundled config{hint} "
                       f"(bundled configs: {', '.join(names)})")


def bundled(name: str, folder: str | None = None) -> Path:
    """The path of the bundled config `name` (e.g. "sim/dora_64", "tool_add_tiny"; with
    `folder`, "dora_64" also finds "sim/dora_64"); a `ConfigError` listing the bundled names if
    there is none."""
    path = find_bundled(name, folder)
    if path is None:
        raise _unknown(str(name), folder)
    return path


def resolve_config(path_or_name: str | Path | None, folder: str | None = None) -> Path | None:
    """What a command's config argument names: a file that exists (it wins), else the bundled
    config of that name. None stays None (the built-in defaults). A missing absolute path is
    returned as given, for the loader to report as a missing file."""
    if path_or_name is None:
        return None
    path = Path(path_or_name)
    if path.exists() or path.is_absolute():
        return path
    return bundled(str(path_or_name), folder)

"""The config a command line names: `[CONFIG] [KEY=VALUE ...]` split, a scenario's name
resolved, and `eddy config show`, which prints the result."""

from __future__ import annotations

import argparse
import json
from typing import Sequence


def split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[config.yaml] [key=value ...]`: the first argument is a file (or a bundled
    config's name) unless it has an '='."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def scenario_path(name: str | None) -> str | None:
    """A scenario file, or the name of a bundled one (`dora_64`, i.e. `sim/dora_64`)."""
    from .config import resolve_config

    path = resolve_config(name, folder="sim")
    return None if path is None else str(path)


def cmd_config_show(ns: argparse.Namespace) -> int:
    from .config import load_config, read_yaml, resolve_config, to_yaml

    path, overrides = split_config_args(ns.args)
    resolved = resolve_config(path)
    # a scenario (a `sim` section) is shown as `eddy sim` reads it
    if (resolved is not None and resolved.is_file() and "sim" in read_yaml(resolved)) or \
            any(item.startswith("sim.") for item in overrides):
        from .sim.config import load_scenario

        config = load_scenario(resolved, overrides)
    else:  # without the model's files: a recipe shows before its model is downloaded
        config = load_config(resolved, overrides, check_files=False)
    if getattr(ns, "diff", False):  # what a mode or recipe changes, and nothing else
        from .config.resumed import differences

        for key, _, value in differences(type(config)(), config):
            print(f"{key}: {json.dumps(value)}")
        return 0
    print(to_yaml(config), end="")
    return 0

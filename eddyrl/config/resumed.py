"""The config a resumed run goes on with, and the one `eddy eval` scores a run's checkpoint
with: the run's own saved `config.yaml`, with the command line's overrides on top, and what
they change said in one line.

Before, `eddy train resume=auto run_dir=R` started from the defaults: a run that had been
started with `loop.steps=40 checkpoint.every=5` went on to step 100 with no checkpoints, and
nothing said so. Now `resume=` with a `run_dir` that holds a saved config and no config file
on the command line loads that config; a config file given as well is used as given, and the
keys where it differs from the saved one are named.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from .loader import load_config, parse_overrides
from .schema import EddyConfig

SAVED = "config.yaml"  # in the run directory (launch.py writes it)
_NOT_SETTINGS = {"resume", "run_dir"}  # where and how to go on, not what the run is
# Resolved for the machine that wrote the config (`platform: auto` saved as the platform it
# found): a resume resolves them anew, from the command line or `auto`, and the checkpoint's
# own check (run_state.check_platforms) refuses a silent change of devices.
MACHINE_KEYS = ("platform", "rollout.platform", "train.platform")
_SHOWN = 8  # differences named in the line


def load_run_config(path: str | None, overrides: Sequence[str]
                    ) -> tuple[EddyConfig, str | None]:
    """The config `eddy train [path] [overrides]` runs with, and a line saying how it relates
    to the run's saved config when it resumes one (None: not a resume, or nothing saved)."""
    tree = parse_overrides(overrides)
    saved = Path(str(tree["run_dir"])) / SAVED if tree.get("resume") and tree.get("run_dir") \
        else None
    if saved is None or not saved.is_file():
        return load_config(path, overrides), None
    before = load_config(saved, check_files=False)
    if path is None:
        config = load_config(saved, [*_machine_defaults(tree), *overrides])
        changed = differences(before, config)
        return config, (f"resume: going on with the run's saved config ({saved})" +
                        (f"; changed by the command line: {_listed(changed)}" if changed
                         else ""))
    config = load_config(path, overrides)
    changed = differences(before, config)
    return config, (f"resume: config '{path}' differs from the run's saved config ({saved}): "
                    f"{_listed(changed)}" if changed else None)


def differences(before: EddyConfig, after: EddyConfig) -> list[tuple[str, Any, Any]]:
    """(key, before, after) for each setting that differs, keys dotted, in order (the
    machine's platform keys aside)."""
    old, new = _flat(dataclasses.asdict(before)), _flat(dataclasses.asdict(after))
    return [(key, old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if key.split(".")[0] not in _NOT_SETTINGS and key not in MACHINE_KEYS
            and old.get(key) != new.get(key)]


def _machine_defaults(tree: dict) -> list[str]:
    """Overrides putting the platform keys the command line does not set back to their
    defaults (`auto`: resolved on this machine)."""
    defaults = _flat(dataclasses.asdict(EddyConfig()))
    out = []
    for key in MACHINE_KEYS:
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            value = defaults[key]
            out.append(f"{key}={'null' if value is None else value}")
    return out


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _listed(changed: list[tuple[str, Any, Any]]) -> str:
    shown = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changed[:_SHOWN])
    return shown + (f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else "")


def load_eval_config(checkpoint: str, path: str | None, overrides: Sequence[str]
                     ) -> tuple[EddyConfig, str, str | None]:
    """The config `eddy eval CHECKPOINT [path] [overrides]` scores with, the checkpoint to
    score, and a line saying where the config came from (None: as given).

    A checkpoint of a run (`R/checkpoint`, `R/checkpoints/step_N`, or the run directory `R`
    itself, which means `R/checkpoint`) is scored with the run's saved config, so a model
    trained on the user's data is evaluated on it, with the overrides on top; a config file
    given is used as given. `data.eval_path` alone is taken for evaluation (the training
    split is not read: the held-out file stands in for it)."""
    target = Path(checkpoint).expanduser()
    run_dir = _run_dir_of(target)
    if run_dir is not None and target == run_dir:
        target = run_dir / "checkpoint"
    overrides = list(overrides)
    tree = parse_overrides(overrides)
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    if data.get("eval_path") is not None and data.get("train_path") is None:
        overrides.append(f"data.train_path={data['eval_path']}")
    saved = run_dir / SAVED if run_dir is not None else None
    if path is not None or saved is None or not saved.is_file():
        return load_config(path, overrides), str(target), None
    config = load_config(saved, [*_machine_defaults(tree), *overrides])
    return config, str(target), f"eval: with the run's saved config ({saved})"


def _run_dir_of(target: Path) -> Path | None:
    """The run directory a checkpoint path belongs to (None: not a run's)."""
    for candidate in (target, target.parent, target.parent.parent):
        if (candidate / SAVED).is_file() and (candidate / "metrics.jsonl").exists():
            return candidate
    return None

"""Workers get their own settings only: below the driver (`launch.py`, `resolved.py`) no
function or class of `eddyrl/runtime/` takes the whole config. The runtimes (ray.py, local.py,
inprocess.py), the workers (rollout_worker.py, trainer_rank.py, workers.py), Ray's
placement, recovery and calls (ray_*.py) and the devices (devices.py) are told their own
sections (`runtime/settings.py`). Read from the source, nothing imported."""

from __future__ import annotations

import ast

from import_graph import ROOT

# Driver-side helpers that read the config to resolve it, and the config's own section.
RESOLVING = {"placement.py", "config.py"}


def whole_config_parameters(source: str) -> list[str]:
    """`function(parameter)` for every parameter annotated with `EddyConfig`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None and arg.annotation is not None \
                    and "EddyConfig" in ast.unparse(arg.annotation):
                found.append(f"{node.name}({arg.arg})")
    return found


def test_no_runtime_worker_takes_the_whole_config():
    modules = sorted(p for p in (ROOT / "runtime").rglob("*.py") if p.name not in RESOLVING)
    assert {"rollout_worker.py", "trainer_rank.py", "local.py"} <= {p.name for p in modules}
    offenders = {str(p.relative_to(ROOT)): found for p in modules
                 if (found := whole_config_parameters(p.read_text()))}
    assert not offenders, f"these take the whole EddyConfig, not their own sections: {offenders}"


def test_the_check_finds_a_whole_config_parameter():
    source = ("class Worker:\n"
              "    def __init__(self, config: 'EddyConfig', index: int) -> None: ...\n"
              "def start(*, settings: EddyConfig | None = None): ...\n")
    assert sorted(whole_config_parameters(source)) == ["__init__(config)", "start(settings)"]

"""The code's shape, checked from the source: which package may import which, no package
import cycle, sans-IO modules that load no torch, no capability looked up with getattr, and
every runtime against the runtime protocols."""

import re
import subprocess
import sys

import pytest

from .import_graph import ROOT, cycles, graph, package_graph, package_of

# Modules with no clock, no I/O and no tensors: importing any of them loads no torch (and no
# Ray), so the logic they hold is testable and usable without either.
SANS_IO = [
    "eddyrl.protocol", "eddyrl.runtime.protocol",
    "eddyrl.core.version_window", "eddyrl.core.version_assignment", "eddyrl.core.ledger",
    "eddyrl.core.replay", "eddyrl.core.store", "eddyrl.core.step_metrics",
    "eddyrl.core.rollout", "eddyrl.core.controller", "eddyrl.core.elastic_driver",
    "eddyrl.core.adaptive_driver", "eddyrl.core.requests", "eddyrl.core.streams",
    "eddyrl.core.moves", "eddyrl.core.turns", "eddyrl.core.placement", "eddyrl.core.partition",
    "eddyrl.scheduler.buckets", "eddyrl.scheduler.prefix_tree", "eddyrl.scheduler.elastic",
    "eddyrl.scheduler.adaptive", "eddyrl.scheduler.plan_predictor",
    "eddyrl.scheduler.cost_model",
    "eddyrl.engines.inference.versions",
    "eddyrl.sim.clock", "eddyrl.sim.runs", "eddyrl.sim.workload",
    "eddyrl.envs.base", "eddyrl.envs.episode",
]

# package -> packages it must never import (at import time or in a function)
FORBIDDEN = {
    "core": {"engines", "runtime", "sim", "config"},
    "engines": {"core", "sim", "scheduler", "runtime"},
    "envs": {"scheduler", "core"},
    "scheduler": {"core", "engines", "runtime", "sim"},
    "hal": {"core", "engines", "runtime", "sim", "scheduler"},
    "protocol": {"core", "engines", "runtime", "sim", "scheduler", "envs", "hal"},
    # the user-code pool is below everything that runs user code (core, envs): it knows
    # callables and pickles, nothing of rollouts, engines or environments
    "usercode": {"core", "engines", "runtime", "sim", "scheduler", "envs", "hal", "config",
                 "tasks", "models", "observability", "launch", "build"},
}


def test_import_directions():
    broken = sorted((source, target) for source, targets in graph().items()
                    for target in targets
                    if package_of(target) in FORBIDDEN.get(package_of(source), ()))
    assert not broken, "imports against the layout:\n" + "\n".join(
        f"  {s} -> {t}" for s, t in broken)


def test_no_package_level_import_cycle():
    assert cycles(package_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_sans_io_modules_load_no_torch_and_no_ray():
    code = ("import importlib, sys\n"
            f"for name in {SANS_IO!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_core_asks_the_runtime_no_getattr_question():
    found = [f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}"
             for path in (ROOT / "core").rglob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"(getattr|hasattr)\(\s*self\.runtime|getattr\(\s*runtime", line)]
    assert not found, "\n".join(found)


def _runtimes():
    from eddyrl.observability.tracing import TracingRuntime, _traced_class
    from eddyrl.runtime.inprocess import InProcessRuntime
    from eddyrl.runtime.protocol import Checkpointable, Elastic, Plannable, Recoverable
    from eddyrl.sim.runtime import SimRuntime

    ray = pytest.importorskip("eddyrl.runtime.ray")
    every = (Elastic, Recoverable, Checkpointable, Plannable)
    return [(ray.RayRuntime, every), (SimRuntime, (Elastic, Plannable)),
            (InProcessRuntime, ()), (TracingRuntime, ()),
            *((_traced_class(caps), caps) for caps in
              [every, (Elastic, Plannable), (Recoverable,), (Checkpointable,)])]


def test_every_runtime_conforms_to_the_protocols_it_claims():
    from eddyrl.runtime.protocol import CAPABILITIES, Runtime, conforms

    for cls, claimed in _runtimes():
        assert conforms(cls, Runtime) == [], cls
        for capability in CAPABILITIES:
            problems = conforms(cls, capability)
            if capability in claimed:
                assert problems == [], (cls, capability)
            else:  # what it does not claim, it does not half-implement either
                assert problems, (cls, capability)


def test_conforms_names_a_wrong_signature():
    from eddyrl.runtime.protocol import Runtime, conforms

    class Wrong:
        workers: list

        def now(self): ...
        def generate(self, worker, requests): ...
        async def abort(self, worker, request_ids): ...
        async def train(self, batch): ...  # no replicas
        def sync_weights(self, version, hold=()): ...  # not a coroutine
        async def worker_stats(self): ...

    problems = conforms(Wrong, Runtime)
    assert any("Wrong.train" in p for p in problems)
    assert any("Wrong.sync_weights is not a coroutine" in p for p in problems)

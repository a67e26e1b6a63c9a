"""The code's shape, checked by importing it (test_layout.py reads the source): the sans-IO
modules load no torch and no Ray in a fresh interpreter, and every runtime conforms to the
runtime protocols it claims, and half-implements none it does not."""

import subprocess
import sys

import pytest

from import_graph import ROOT

# Modules with no clock, no I/O and no tensors: importing any of them loads no torch (and no
# Ray), so the logic they hold is testable and usable without either.
SANS_IO = [
    "eddyrl.protocol", "eddyrl.runtime_protocol",
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


def test_sans_io_modules_load_no_torch_and_no_ray():
    code = ("import importlib, sys\n"
            f"for name in {SANS_IO!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _runtimes():
    from eddyrl.observability.tracing import TracingRuntime, _traced_class
    from eddyrl.runtime.inprocess import InProcessRuntime
    from eddyrl.runtime_protocol import (Checkpointable, Elastic, Plannable, Recoverable,
                                         TrainerRecoverable)
    from eddyrl.sim.runtime import SimRuntime

    ray = pytest.importorskip("eddyrl.runtime.ray")
    every = (Elastic, Recoverable, Checkpointable, Plannable, TrainerRecoverable)
    return [(ray.RayRuntime, every), (SimRuntime, (Elastic, Plannable)),
            (InProcessRuntime, ()), (TracingRuntime, ()),
            *((_traced_class(caps), caps) for caps in
              [every, (Elastic, Plannable), (Recoverable,), (Checkpointable,),
               (TrainerRecoverable,)])]


def test_every_runtime_conforms_to_the_protocols_it_claims():
    from eddyrl.runtime_protocol import CAPABILITIES, Runtime, conforms

    for cls, claimed in _runtimes():
        assert conforms(cls, Runtime) == [], cls
        for capability in CAPABILITIES:
            problems = conforms(cls, capability)
            if capability in claimed:
                assert problems == [], (cls, capability)
            else:  # what it does not claim, it does not half-implement either
                assert problems, (cls, capability)

"""The engines on each accelerator present here (CUDA, NPU, plug-ins whose device is not the CPU).

Without an accelerator every test here skips, naming the HAL's reason. `EDDY_TEST_PLATFORMS=cpu`
(a comma-separated list of platform names) runs them on the named platforms instead, e.g. on the
CPU to check the tests themselves on a machine with no accelerator. `EDDY_HARDWARE_REPORT=<file>`
appends what the tests measured (log-prob gaps, memory) to that file as JSON lines.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from eddyrl.hal import get_platform, known_platforms

PLATFORMS_ENV = "EDDY_TEST_PLATFORMS"
REPORT_ENV = "EDDY_HARDWARE_REPORT"

# The tiny-model batch helpers of the FSDP engine tests (also imported by spawned ranks).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))


def _accelerator_params():
    chosen = [n.strip() for n in os.environ.get(PLATFORMS_ENV, "").split(",") if n.strip()]
    if not chosen:
        chosen = [name for name in known_platforms()
                  if get_platform(name, require_available=False).device_type != "cpu"]
    params = []
    for name in chosen:
        marks = []
        if name in known_platforms():
            reason = get_platform(name, require_available=False).unavailable_reason()
            if reason:
                marks.append(pytest.mark.skip(reason=f"{name}: {reason}"))
        params.append(pytest.param(name, marks=marks, id=name))  # unknown: the fixture says so
    return params


@pytest.fixture(params=_accelerator_params())
def accelerator(request):
    """A platform these tests run on (an accelerator unless EDDY_TEST_PLATFORMS names others)."""
    return get_platform(request.param)


@pytest.fixture
def hardware_report(request):
    """`hardware_report(**values)`: print what a test measured and, with EDDY_HARDWARE_REPORT
    set, append it as one JSON line (the device check script collects these)."""
    def report(**values):
        line = json.dumps({"test": request.node.nodeid, **values}, default=str)
        print(line)
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
    return report

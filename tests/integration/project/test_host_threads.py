"""Every Eddy process makes its OpenMP threads sleep while they wait (GOMP_SPINCOUNT=0, set when
`eddyrl` is imported, before torch), unless the user set the variable: spinning threads took the
CPU from the thread a train step waited for on a busy machine (bench/profile_step.py)."""

import os
import subprocess
import sys

PROBE = "import eddyrl, os; print(os.environ['GOMP_SPINCOUNT'])"


def _spincount(**env):
    clean = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    return subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                          capture_output=True, text=True, check=True).stdout.strip()


def test_eddy_processes_wait_without_spinning_unless_the_user_says_otherwise():
    assert _spincount() == "0"
    assert _spincount(GOMP_SPINCOUNT="300000") == "300000"


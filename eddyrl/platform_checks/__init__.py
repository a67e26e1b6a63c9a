"""The platform contract, shipped in the package so that a vendor who writes a `Platform`
plug-in can check it from an installed wheel: `eddy platforms check NAME`.

- `contract`: the `Platform` hooks, in this process (tests/fast/hal/test_contract.py runs them too);
- `collectives`: two spawned processes in one group (tests/integration/hal/test_distributed.py);
- `engines`: the `hf` inference engine and the FSDP trainer on the device, with the tiny model
  shipped in `eddyrl/assets`;
- `varlen`: packed training's variable-length attention, where the platform has one (group
  `engines`);
- `runner`: the checks by name and group, each run isolated (`run_checks`).

It uses `eddyrl.hal` and never the other way round: the HAL does not know it exists.
"""

from .common import CheckSkipped
from .runner import CHECKS, GROUPS, Check, CheckResult, UnknownCheck, names_in, run_check, \
    run_checks, select

__all__ = ["CHECKS", "GROUPS", "Check", "CheckResult", "CheckSkipped", "UnknownCheck",
           "names_in", "run_check", "run_checks", "select"]

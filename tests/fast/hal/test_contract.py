"""What every platform must do, checked on each platform present on this machine (plug-ins
included). The checks are the package's own (`eddyrl/platform_checks/contract.py`): the code
`eddy platforms check NAME` runs from an installed wheel, so the two cannot drift apart."""

import inspect

import pytest

from eddyrl.platform_checks import CHECKS, names_in
from eddyrl.platform_checks import contract

PLATFORM_CHECKS = names_in("platform")


@pytest.mark.parametrize("check", PLATFORM_CHECKS)
def test_platform_contract(platform, check):
    CHECKS[check](platform)  # raises, with a message naming what was wrong


def test_every_contract_function_is_a_registered_check():
    functions = {f for name, f in inspect.getmembers(contract, inspect.isfunction)
                 if name.startswith("check_") and f.__module__ == contract.__name__}
    registered = {CHECKS[name].function for name in PLATFORM_CHECKS}
    assert functions == registered, sorted(f.__name__ for f in functions ^ registered)

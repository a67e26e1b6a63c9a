"""A real 2-process group through the HAL: collectives and the collective weight channel. The
checks are the package's own (`eddyrl/platform_checks/collectives.py`), the code that
`eddy platforms check NAME` runs; they spawn the two ranks and kill them at a deadline."""

import pytest
import torch.multiprocessing as mp

from eddyrl.platform_checks import CHECKS, CheckSkipped, names_in


@pytest.mark.parametrize("check", names_in("collectives"))
def test_two_process_checks(platform, check):
    try:
        CHECKS[check](platform)
    except CheckSkipped as skip:  # e.g. an accelerator with one device
        pytest.skip(str(skip))
    assert not mp.active_children(), mp.active_children()  # the check left no rank behind

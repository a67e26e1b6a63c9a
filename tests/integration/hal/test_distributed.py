"""A real 2-process group through the HAL: collectives and the collective weight channel. The
checks are the package's own (`eddyrl/platform_checks/collectives.py`), the code that
`eddy platforms check NAME` runs; they spawn the two ranks and kill them at a deadline."""

import pytest
import torch.multiprocessing as mp

from eddyrl.platform_checks import CHECKS, CheckSkipped, names_in


@pytest.mark.parametrize("check", names_in("collectives"))
def test_two_process_checks(platform, check):
    before = set(mp.active_children())  # e.g. a vLLM engine-core process another test keeps
    try:
        CHECKS[check](platform)
    except CheckSkipped as skip:  # e.g. an accelerator with one device
        pytest.skip(str(skip))
    left = set(mp.active_children()) - before
    assert not left, left  # the check left no rank behind

"""What every check module shares: how a check says "not applicable here", and the device it
runs on."""

from __future__ import annotations

import torch

from ..hal import Platform

MiB = 2**20


class CheckSkipped(Exception):
    """Raised by a check that cannot run on this platform (e.g. two ranks on one device); the
    message says why. The runner records it as "skipped", pytest as a skip."""


def device_of(platform: Platform) -> torch.device:
    """This process's device, as the engines pick it."""
    return platform.device(platform.local_rank())

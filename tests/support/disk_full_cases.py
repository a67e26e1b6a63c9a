"""Shared by the full-disk tests: ENOSPC as write() raises it, and the exception
torch.distributed.checkpoint wraps it in."""

import errno
import os

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name


def checkpoint_exception(error: OSError) -> BaseException:
    """What torch.distributed.checkpoint raises for a rank's failed write."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise error
    except OSError as exc:
        return CheckpointException("save failed", {0: _wrap_exception(exc)})

"""The process's umask, read without changing it: `os.umask` can only be read by setting it,
which a thread running beside the reader would see (a file created meanwhile gets the wrong
mode). Linux says it in /proc/self/status; elsewhere it is set and put back.

Its own module: the user-code pool (usercode/) opens no file (tests/integration/engines/
test_no_pickle_checkpoints.py), and this reads one of the kernel's.
"""

from __future__ import annotations

import os

_STATUS: list[int] = []  # [pid, fd of its /proc/self/status], kept: opening costs most


def current_umask() -> int:
    """The umask, read without changing it where the kernel says it (Linux)."""
    try:
        if not _STATUS or _STATUS[0] != os.getpid():  # first use, or a fork's copy
            _STATUS[:] = [os.getpid(), os.open("/proc/self/status", os.O_RDONLY)]
        status = os.pread(_STATUS[1], 1 << 14, 0)
        start = status.index(b"Umask:") + 6
        return int(status[start:status.index(b"\n", start)], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # elsewhere: set and put back (0o077 meanwhile: never looser)
    os.umask(mask)
    return mask

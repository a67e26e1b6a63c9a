"""This process's resident memory, as the memory benchmarks read it (Linux /proc): the current
resident set, and its peak since the last reset."""

from __future__ import annotations


def status_bytes(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM; kB there) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Reset the peak resident memory to the current one (VmHWM := VmRSS) and return it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")

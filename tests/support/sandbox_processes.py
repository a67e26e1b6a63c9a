"""The Python tool's sandbox processes as the tests find them in /proc (shared by
tests/integration/envs/test_python_tool.py and tests/faults/test_sandbox_escapes.py)."""

from __future__ import annotations

import os


def alive(pid) -> bool:
    """Running, and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sandbox_processes() -> list[int]:
    """The live processes of this process's sandboxes (and whatever they forked), launcher
    first: child.py's command line, copied by a fork, carries this process's pid after `-c`
    and two more fields."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"-c" in args and args[args.index(b"-c") + 4:][:1] == [str(os.getpid()).encode()] \
                and alive(entry):
            found.append(int(entry))
    return sorted(found)  # the launcher was started first: the lowest pid (no wrap-around
                          # within one run on a pid_max of 2^22)

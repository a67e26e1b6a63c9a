"""The Python tool's sandbox: model-written code in a fresh interpreter, behind an OS boundary.

`child.py` says exactly what runs where. In short, with `isolation="namespaces"` (what `auto`
picks wherever the one-time probe succeeds) each run is a fresh `python -I -S` in new mount,
network, PID, IPC, UTS and cgroup namespaces (and a user namespace when Eddy is not root), in
a root that holds only the standard library and shared-library directories (read-only), five
/dev nodes, its own /proc and a fresh tmpfs work directory; it runs as nobody with no
capabilities, no network (a loopback device, down), a seccomp filter against processes, exec,
mounts, ptrace, signals to others and other kernel attack surface, and the time, memory,
file-size, work-directory, open-file and output limits. The wall-time limit kills the process
group and with it the PID namespace's init, after which the kernel kills everything left
inside.

`isolation="none"` (and `auto` where namespaces are unavailable, with one warning naming why)
keeps the limits, the seccomp filter and the audit hook but runs in the host's namespaces as
Eddy's user: that is careless-code protection, not a boundary against hostile code. The filter
(`seccomp.py`, x86_64 and aarch64) keeps signals from reaching any other process in every mode,
the driver included (kill, and SIGIO's routes: fcntl F_SETOWN/F_SETSIG/O_ASYNC, ioctl
FIOSETOWN/FIOASYNC). Where there is no filter (another architecture or OS, or the kernel
refuses it) the first run warns, naming what is left open in its mode.
"""

from .runner import (ISOLATIONS, PythonSandbox, SandboxError, SandboxLimits, SandboxResult,
                     SandboxUnavailable, Support, namespace_support)

__all__ = ["ISOLATIONS", "PythonSandbox", "SandboxError", "SandboxLimits", "SandboxResult",
           "SandboxUnavailable", "Support", "namespace_support"]

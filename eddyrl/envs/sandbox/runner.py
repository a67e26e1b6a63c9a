"""The parent side of the sandbox: start `child.py`, feed it the code, enforce the wall-time and
output limits, kill what is left, and say what happened. See the package docstring for the
boundary."""

from __future__ import annotations

import asyncio
import functools
import logging
import marshal
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import EddyError

log = logging.getLogger(__name__)

# The child imports nothing of Eddy's: the filter's module goes ahead of child.py in the one
# script it runs.
CHILD = "\n".join(Path(__file__).with_name(name).read_text()
                  for name in ("seccomp.py", "child.py"))
# Compiling child.py takes longer than starting the interpreter: when the child is this same
# interpreter, it gets the code object, marshalled, ahead of the model's code on stdin.
_STUB = ("import marshal, sys\n"
         "exec(marshal.loads(sys.stdin.buffer.read(int(sys.stdin.buffer.readline()))))")


@functools.cache
def _prefix() -> bytes:
    compiled = marshal.dumps(compile(CHILD, "<sandbox>", "exec"))
    return b"%d\n%b" % (len(compiled), compiled)
ISOLATIONS = ("auto", "namespaces", "none")
SETUP_FAILED = 125  # child.py's exit status when its setup failed
_FLAGS = ("-I", "-S", "-B", "-u", "-X", "utf8")


class SandboxUnavailable(EddyError, RuntimeError):
    """isolation='namespaces' on a machine where the probe failed; the message says why."""


class SandboxError(EddyError, RuntimeError):
    """The sandbox could not be set up for a run (not the code's fault)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 512 << 20  # address space
    file_bytes: int = 16 << 20  # largest file it may write
    output_bytes: int = 8192  # kept of stdout (its head) and of stderr (its tail)
    code_bytes: int = 64 << 10
    workdir_bytes: int = 64 << 20  # all its files together (a tmpfs; with namespaces only)

    def __post_init__(self) -> None:
        for key in ("wall_s", "cpu_s", "memory_bytes", "file_bytes", "output_bytes",
                    "code_bytes", "workdir_bytes"):
            if not getattr(self, key) > 0:
                raise ValueError(f"SandboxLimits.{key} = {getattr(self, key)!r} must be > 0")


@dataclass(frozen=True, slots=True)
class SandboxResult:
    status: str  # success | failure | timeout
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    truncated: bool = False  # stdout or stderr was cut to output_bytes
    error: str | None = None  # one line: the exception, the limit hit, or the exit code

    def output(self) -> str:
        """What the model is shown: stdout, then stderr's tail (the traceback) or the limit."""
        parts = [self.stdout]
        if self.status != "success":
            parts.append(self.stderr if self.stderr else f"{self.error}\n")
        return "".join(parts)


@dataclass(frozen=True, slots=True)
class Support:
    """Whether namespaces mode works here (`reason` says why not), and whether through a user
    namespace (always when not root; as root, where the plain route is refused, as in a
    container without CAP_SYS_ADMIN that allows user namespaces)."""
    ok: bool
    reason: str = ""
    userns: bool = False


class PythonSandbox:
    """Runs code in a fresh interpreter. `isolation`: `namespaces` (the OS boundary; refuses to
    run where the probe fails), `none` (rlimits, seccomp and the audit hook only: not a
    boundary), `auto` (namespaces where they work, else none with one warning saying why).
    `audit_hook` and `seccomp` turn those layers off: for tests of the others alone."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable,
                 *, isolation: str = "auto", audit_hook: bool = True,
                 seccomp: bool = True) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"PythonSandbox isolation = {isolation!r} is not one of "
                             f"{', '.join(ISOLATIONS)}")
        self.limits = limits
        self.python = python
        self.isolation = isolation
        self.layers = ",".join(["hook"] * audit_hook + ["seccomp"] * seccomp) or "-"
        self._same = os.path.realpath(python) == os.path.realpath(sys.executable)

    async def mode(self) -> str:
        """The mode runs use here: 'namespaces' or 'none' (probing once per interpreter)."""
        return (await self._mode())[0]

    async def _mode(self) -> tuple[str, str]:
        """(the mode, the layers child.py is given)."""
        if self.isolation == "none":
            return "none", self.layers
        support = _SUPPORT.get(self.python)
        if support is None:
            support = await asyncio.to_thread(namespace_support, self.python)
        if support.ok:
            return "namespaces", self.layers + ",userns" * support.userns
        if self.isolation == "namespaces":
            raise SandboxUnavailable(f"the Python sandbox's isolation 'namespaces' is not "
                                     f"available here: {support.reason} ({HINT}; or set "
                                     f"env.options.isolation to auto or none)")
        _warn_fallback(support.reason)
        return "none", self.layers

    async def run(self, code: str) -> SandboxResult:
        start = time.monotonic()
        source = code.encode("utf-8", "replace")
        if len(source) > self.limits.code_bytes:
            return SandboxResult("failure", "", "", None, 0.0,
                                 error=f"code is {len(source)} bytes, the limit is "
                                       f"{self.limits.code_bytes}")
        mode, layers = await self._mode()
        with tempfile.TemporaryDirectory(prefix="eddy-python-") as base:
            returncode, timed_out, out, err, status = await self._execute(
                source, mode, layers, _layout(base, mode, self.limits))
        if returncode == SETUP_FAILED and status.startswith("error:"):
            raise SandboxError(f"the Python sandbox could not start: {status[7:].strip()}")
        if status.startswith(UNFILTERED):
            _warn_unfiltered(mode, status[len(UNFILTERED):].strip())
        return _result(returncode, timed_out, out, err, time.monotonic() - start,
                       self.limits)

    def argv(self, mode: str, layers: str, status_fd: int, layout: tuple[str, ...]
             ) -> list[str]:
        limits = self.limits
        return [self.python, *_FLAGS, "-c", _STUB if self._same else CHILD, mode,
                str(status_fd), str(os.getpid()), str(limits.memory_bytes), str(limits.cpu_s),
                str(limits.file_bytes), layers, *layout]

    def stdin(self, source: bytes) -> bytes:
        return _prefix() + source if self._same else source

    async def _execute(self, source: bytes, mode: str, layers: str, layout: tuple[str, ...]):
        limits = self.limits
        status_r, status_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(mode, layers, status_w, layout), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                cwd=layout[0] if mode == "none" else "/", env=_clean_env(layout[0]),
                start_new_session=True, pass_fds=(status_w,))
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        readers = (asyncio.ensure_future(_read_capped(proc.stdout, limits.output_bytes, False)),
                   asyncio.ensure_future(_read_capped(proc.stderr, limits.output_bytes, True)))
        timed_out = False
        try:
            try:
                proc.stdin.write(self.stdin(source))
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # it ended before reading its code; the exit status says why
            await asyncio.wait_for(proc.wait(), limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # also on cancellation: nothing of the run outlives it
            if proc.returncode is None:  # still ours: its group id cannot have been reused
                _kill_group(proc.pid)  # the launcher and, inside, the PID namespace's init
            await proc.wait()
            status = _read_status(status_r)
        try:  # the pipes close when the last process holding them is gone
            out, err = await asyncio.wait_for(asyncio.gather(*readers), 1.0)
        except asyncio.TimeoutError:
            out, err = (b"", 0), (b"", 0)
        return proc.returncode, timed_out, out, err, status


def _layout(base: str, mode: str, limits: SandboxLimits) -> tuple[str, ...]:
    """child.py's arguments after the layers: the work directory (the code's cwd; in
    namespaces mode a tmpfs at the same path inside), and in namespaces mode the empty
    directory the new root is mounted on and the work directory's size."""
    if mode == "none":
        return (base,)
    root = os.path.join(base, "root")
    os.mkdir(root, 0o700)
    return base, root, str(limits.workdir_bytes)


def _read_status(fd: int) -> str:
    """What child.py wrote on its status pipe ('ready', or 'error: ...'). Every writer has
    ended by now; non-blocking all the same, so that a survivor cannot hang the loop."""
    try:
        os.set_blocking(fd, False)
        chunks = []
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


HINT = ("namespaces need root, or unprivileged user namespaces (sysctl user.max_user_namespaces "
        "> 0, and kernel.unprivileged_userns_clone=1 or "
        "kernel.apparmor_restrict_unprivileged_userns=0 where those exist); in a container, "
        "CAP_SYS_ADMIN or a seccomp profile that allows unshare")
_SUPPORT: dict[str, Support] = {}
_PROBE_LOCK = threading.Lock()
_WARNED: set[str] = set()


def namespace_support(python: str = sys.executable) -> Support:
    """Whether namespaces mode works on this machine for `python`: one real run of the probe
    (about as long as a tool call), then the cached answer."""
    with _PROBE_LOCK:
        if python not in _SUPPORT:
            _SUPPORT[python] = _probe(python)
        return _SUPPORT[python]


def _probe(python: str) -> Support:
    if sys.platform != "linux":
        return Support(False, f"namespaces are Linux-only (this is {sys.platform})")
    problem = _probe_run(python, "hook,seccomp")
    if problem is None:
        return Support(True, userns=os.geteuid() != 0)
    if os.geteuid() == 0:  # refused as root (a container): perhaps a user namespace works
        second = _probe_run(python, "hook,seccomp,userns")
        if second is None:
            return Support(True, userns=True)
        problem = f"{problem}; through a user namespace: {second}"
    return Support(False, problem)


def _probe_run(python: str, layers: str) -> str | None:
    """One run of the probe: None when it worked, else why not."""
    sandbox = PythonSandbox(SandboxLimits(wall_s=30.0), python, isolation="namespaces")
    with tempfile.TemporaryDirectory(prefix="eddy-python-") as base:
        layout = _layout(base, "namespaces", sandbox.limits)
        status_r, status_w = os.pipe()
        try:
            done = subprocess.run(sandbox.argv("namespaces", layers, status_w, layout),
                                  input=sandbox.stdin(b"print('eddy-sandbox-probe')"),
                                  capture_output=True, timeout=60, cwd="/",
                                  env=_clean_env(base), start_new_session=True,
                                  pass_fds=(status_w,))
        except (OSError, subprocess.TimeoutExpired) as exc:
            os.close(status_w)
            _read_status(status_r)
            return f"the probe run failed: {exc}"
        os.close(status_w)
        status = _read_status(status_r)
    if done.returncode == 0 and done.stdout == b"eddy-sandbox-probe\n":
        return None
    if status.startswith("error:"):
        return status[7:].strip()
    tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
    return f"the probe run ended with exit status {done.returncode}" + \
        (f": {tail[0]}" if tail else "")


def _warn_fallback(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("the Python sandbox runs without namespaces (isolation 'auto' fell back to "
                    "'none': rlimits, seccomp and an audit hook, not a boundary against "
                    "hostile code): %s (%s)", reason, HINT)


UNFILTERED = "ready; no seccomp filter: "  # child.py's status line where the filter is missing
NOT_ISOLATED = {
    "none": "model code can signal other processes (the training driver included), start "
            "processes and open network sockets, refused only by the audit hook, which is "
            "not a boundary; use isolation 'namespaces' or a container",
    "namespaces": "the namespaces still keep it from other processes, the network and the "
                  "host's files, but every system call is open to it (mount, bpf, io_uring, "
                  "keyctl...) and it can start up to 64 processes",
}


def _warn_unfiltered(mode: str, why: str) -> None:
    """Once per mode and reason: the run had no seccomp filter, and what that leaves open."""
    key = f"{mode}: {why}"
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("the Python sandbox runs without its seccomp filter (%s) in isolation "
                    "'%s': %s", why, mode, NOT_ISOLATED[mode])


def _clean_env(workdir: str) -> dict[str, str]:
    """Only what an interpreter needs: no proxies, tokens or library paths leak in."""
    return {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


async def _read_capped(stream: asyncio.StreamReader, cap: int, tail: bool) -> tuple[bytes, int]:
    """Drain `stream` to its end keeping `cap` bytes (the first, or the last when `tail`), so a
    print loop cannot fill the host's memory; returns them and the total size."""
    kept, total = bytearray(), 0
    while chunk := await stream.read(1 << 16):
        total += len(chunk)
        if tail:
            kept += chunk
            if len(kept) > 2 * cap:
                del kept[:-cap]
        elif len(kept) < cap:
            kept += chunk[:cap - len(kept)]
    return bytes(kept[-cap:] if tail else kept), total


def _result(returncode: int | None, timed_out: bool, out: tuple[bytes, int],
            err: tuple[bytes, int], seconds: float, limits: SandboxLimits) -> SandboxResult:
    stdout, stderr = (data.decode("utf-8", "replace") for data, _ in (out, err))
    truncated = out[1] > limits.output_bytes or err[1] > limits.output_bytes
    if timed_out:
        status, error = "timeout", f"timed out after {limits.wall_s}s (wall time)"
    elif returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        status, error = "timeout", f"CPU time limit of {limits.cpu_s}s reached"
    elif returncode == 0:
        status, error = "success", None
    else:
        lines = stderr.strip().splitlines()
        status, error = "failure", lines[-1] if lines else f"exit code {returncode}"
    return SandboxResult(status, stdout, stderr, returncode, seconds, truncated, error)

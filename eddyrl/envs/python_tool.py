"""A sandboxed Python tool: run model-written code in a fresh interpreter with time, memory and
file-size limits, no network, no child processes, writes confined to a temporary directory.

Each run is `python -I -S` (no user site, no site-packages, no PYTHON* variables) in its own
process group and session, with a clean environment (no proxies, no credentials) and a fresh
temporary directory as cwd, deleted afterwards. A bootstrap, run before the code, sets the
resource limits (RLIMIT_AS: a memory bomb is the child's MemoryError, never the host's OOM;
RLIMIT_CPU; RLIMIT_FSIZE; RLIMIT_NPROC; no core files) and installs an audit hook that refuses
every socket event, process creation, ctypes, and writes outside the directory. The limits are
set by the child itself rather than in `preexec_fn`, which is unsafe in a threaded parent (Ray
workers are). The wall-time limit kills the whole process group.

What this is not: a security boundary against hostile code. Audit hooks are in-process and
RLIMIT_NPROC does not bind root; model-written code in RL is careless, not adversarial. For
untrusted code, run this same tool inside an OS sandbox (a container, nsjail, bubblewrap) that
adds network and filesystem namespaces.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from .tool_env import ToolEnv, ToolResult, ToolSyntax

_BOOTSTRAP = r'''
import linecache, os, resource, signal, sys, traceback
source = sys.stdin.read()
sys.stdin = open(os.devnull)
memory, cpu, fsize = map(int, sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE raises OSError

def install(workdir=os.path.realpath(os.getcwd()) + os.sep, realpath=os.path.realpath,
            fsdecode=os.fsdecode, writing=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND
            | os.O_TRUNC):
    refused = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
               "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
               "ctypes.cdata", "ctypes.call_function", "sys.addaudithook"}
    changes = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.symlink": 2,
               "os.link": 2, "os.truncate": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1}

    def inside(path):
        return isinstance(path, int) or (realpath(fsdecode(path)) + os.sep).startswith(workdir)

    def hook(event, args):
        if event.startswith("socket.") or event in refused:
            raise PermissionError(f"sandbox: {event} refused (no network, no processes)")
        if event == "open":
            path, mode, flags = args
            if (any(c in (mode or "") for c in "wax+") or flags & writing) and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} refused (outside the "
                                      "working directory)")
        elif event in changes and not all(inside(p) for p in args[:changes[event]]):
            raise PermissionError(f"sandbox: {event} {args[:2]!r} refused (outside the "
                                  "working directory)")
    sys.addaudithook(hook)

install()
del install
linecache.cache["<tool>"] = (len(source), None, source.splitlines(True), "<tool>")
try:
    exec(compile(source, "<tool>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as exc:
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
'''


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 512 << 20  # address space
    file_bytes: int = 16 << 20  # largest file it may write
    output_bytes: int = 8192  # kept of stdout (its head) and of stderr (its tail)
    code_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for key in ("wall_s", "cpu_s", "memory_bytes", "file_bytes", "output_bytes",
                    "code_bytes"):
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


class PythonSandbox:
    def __init__(self, limits: SandboxLimits = SandboxLimits(),
                 python: str = sys.executable) -> None:
        self.limits = limits
        self.python = python

    async def run(self, code: str) -> SandboxResult:
        start = time.monotonic()
        source = code.encode("utf-8", "replace")
        if len(source) > self.limits.code_bytes:
            return SandboxResult("failure", "", "", None, 0.0,
                                 error=f"code is {len(source)} bytes, the limit is "
                                       f"{self.limits.code_bytes}")
        with tempfile.TemporaryDirectory(prefix="eddy-python-") as workdir:
            returncode, timed_out, out, err = await self._execute(source, workdir)
        return _result(returncode, timed_out, out, err, time.monotonic() - start,
                       self.limits)

    async def _execute(self, source: bytes, workdir: str):
        limits = self.limits
        proc = await asyncio.create_subprocess_exec(
            self.python, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", _BOOTSTRAP,
            str(limits.memory_bytes), str(limits.cpu_s), str(limits.file_bytes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=workdir, env=_clean_env(workdir),
            start_new_session=True)
        readers = (asyncio.ensure_future(_read_capped(proc.stdout, limits.output_bytes, False)),
                   asyncio.ensure_future(_read_capped(proc.stderr, limits.output_bytes, True)))
        timed_out = False
        try:
            try:
                proc.stdin.write(source)
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # it ended before reading its code; the exit status says why
            await asyncio.wait_for(proc.wait(), limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # also on cancellation: nothing of the run outlives it
            if proc.returncode is None:  # still ours: its group id cannot have been reused
                _kill_group(proc.pid)
            await proc.wait()
        try:  # the pipes close with the process (it could start no other)
            out, err = await asyncio.wait_for(asyncio.gather(*readers), 1.0)
        except asyncio.TimeoutError:
            out, err = (b"", 0), (b"", 0)
        return proc.returncode, timed_out, out, err


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


# `<python>print(1)</python>` answered by `<output>1\n</output>`.
PYTHON_SYNTAX = ToolSyntax("<python>", "</python>", "<output>", "</output>")


class PythonEnv(ToolEnv):
    """The model runs code in the sandbox as often as it likes (up to the turn limit); a turn
    without a call is its final answer, scored by `reward_fn(text, answer)`."""

    tool_name = "python"
    syntaxes = {"tags": PYTHON_SYNTAX}

    def __init__(self, *, sandbox: PythonSandbox | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sandbox = sandbox or PythonSandbox()

    async def run_tool(self, argument: str) -> ToolResult:
        result = await self.sandbox.run(argument)
        return ToolResult(result.status, result.output(), result.error)

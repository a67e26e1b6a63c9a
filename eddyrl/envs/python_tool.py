"""The Python tool: the model runs code, as `<python>...</python>`, in the sandbox of
`eddyrl.envs.sandbox` and is shown its output.

The boundary (`isolation` `namespaces`, which the default `auto` picks wherever a one-time
probe finds it works): each run is a fresh interpreter in its own mount, network, PID, IPC,
UTS and cgroup namespaces, as nobody with no capabilities, seeing only the standard library
and the shared libraries (read-only) and a fresh tmpfs work directory; no network; a seccomp
filter against processes, exec, mounts, ptrace and signals to other processes; time, memory,
file-size, work-directory and output limits; at the wall-time limit the process group and the
PID namespace are killed. An audit hook inside refuses sockets, processes, ctypes and reads
and writes outside the work directory as defence in depth. `isolation="none"` (and `auto`
where namespaces are unavailable, with one warning) keeps everything but the namespaces and
is not a boundary against hostile code. Not covered: kernel bugs behind the system calls the
filter allows, contention for CPU and memory bandwidth, reading the standard and system
libraries. SECURITY.md says it all.
"""

from __future__ import annotations

from ..errors import ConfigError
from .sandbox import (ISOLATIONS, PythonSandbox, SandboxError, SandboxLimits, SandboxResult,
                      SandboxUnavailable, namespace_support)
from .tool_env import ToolEnv, ToolResult, ToolSyntax

__all__ = ["PYTHON_SYNTAX", "PythonEnv", "PythonSandbox", "SandboxError", "SandboxLimits",
           "SandboxResult", "SandboxUnavailable", "namespace_support"]

# `<python>print(1)</python>` answered by `<output>1\n</output>`.
PYTHON_SYNTAX = ToolSyntax("<python>", "</python>", "<output>", "</output>")


class PythonEnv(ToolEnv):
    """The model runs code in the sandbox as often as it likes (up to the turn limit); a turn
    without a call is its final answer, scored by `reward_fn(text, answer)`.

    `isolation` (`env.options.isolation`): `auto` (default), `namespaces` or `none`, as in
    `PythonSandbox`; or pass a whole `sandbox`."""

    tool_name = "python"
    syntaxes = {"tags": PYTHON_SYNTAX}

    def __init__(self, *, sandbox: PythonSandbox | None = None, isolation: str | None = None,
                 **kwargs) -> None:
        if isolation is not None and isolation not in ISOLATIONS:
            raise ConfigError(f"config key 'env.options.isolation' = {isolation!r} is not one "
                              f"of {', '.join(map(repr, ISOLATIONS))}")
        if isolation is not None and sandbox is not None:
            raise ConfigError("config key 'env.options.isolation' is set, and so is a whole "
                              "sandbox: set the isolation on the sandbox")
        super().__init__(**kwargs)
        self.sandbox = sandbox or PythonSandbox(isolation=isolation or "auto")

    async def run_tool(self, argument: str) -> ToolResult:
        result = await self.sandbox.run(argument)
        return ToolResult(result.status, result.output(), result.error)

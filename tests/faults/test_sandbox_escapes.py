"""Escapes from the Python tool's sandbox (issue 19, defect 7), each run against every layer:

- `default`: `PythonSandbox(limits)`, what a run gets (`auto`: namespaces here);
- `nohook`: namespaces and seccomp, the audit hook off (as if the code got round it);
- `bare`: namespaces alone, no hook, no seccomp filter;
- `userns`: namespaces through a user namespace (the route of a non-root Eddy);
- `none`: no namespaces: rlimits, seccomp and the hook;
- `seccomp` (only where named): no namespaces and no hook, the filter alone.

The namespace variants skip, saying why, where the probe finds namespaces unavailable. No test
reaches beyond this machine's loopback, and none signals anything but processes it started."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid

import pytest

from eddyrl.envs import python_tool
from eddyrl.envs.python_tool import PythonSandbox, SandboxLimits

from sandbox_processes import alive, sandbox_processes

LIMITS = dict(wall_s=20.0, cpu_s=10, memory_bytes=512 << 20, file_bytes=1 << 20,
              output_bytes=4096)
VARIANTS = {
    "default": {},
    "nohook": dict(isolation="namespaces", audit_hook=False),
    "bare": dict(isolation="namespaces", audit_hook=False, seccomp=False),
    "userns": dict(isolation="namespaces", userns=True),
    "none": dict(isolation="none"),
}
SECCOMP_ONLY = {"seccomp": dict(isolation="none", audit_hook=False)}  # not in every_variant:
# without the hook or namespaces, reading files outside is allowed


def sandbox(variant, **limits):
    options = dict({**VARIANTS, **SECCOMP_ONLY}[variant])
    userns = options.pop("userns", False)
    if options.get("isolation") == "namespaces":
        support = getattr(python_tool, "namespace_support", None)  # absent before issue 19
        if support is not None and not support().ok:
            pytest.skip(f"namespaces are not available here: {support().reason}")
    box = PythonSandbox(SandboxLimits(**{**LIMITS, **limits}), **options)
    if userns:
        box.layers += ",userns"
    return box


def run(variant, code, **limits):
    """Run `code` (dedented, after TRY's `attempt`) in the sandbox of `variant`."""
    return asyncio.run(sandbox(variant, **limits).run(TRY + textwrap.dedent(code)))


def attempts(result):
    """The lines the code printed for each attempt: 'ok ...' where it got through."""
    return [line for line in result.stdout.splitlines() if line.startswith(("ok", "no"))]


TRY = """
def attempt(name, action):
    try:
        value = action()
    except BaseException as exc:
        print("no", name, type(exc).__name__, exc, flush=True)
        return False
    print("ok", name, repr(value)[:80], flush=True)
    return True
"""

every_variant = pytest.mark.parametrize("variant", list(VARIANTS))


@every_variant
def test_os_open_with_dir_fd_writes_nothing_outside(variant, tmp_path):
    """The hook resolved `os.open(name, O_CREAT, dir_fd=fd)` against the cwd, not `fd`."""
    name = f"eddy-escape-{uuid.uuid4().hex}"
    above = os.path.join(os.path.dirname(tmp_path), name)  # beside tmp_path
    parent = os.path.join(os.path.realpath(tempfile.gettempdir()), name)  # the work dir's
    try:
        result = run(variant, f"""
        import os
        flags = os.O_CREAT | os.O_WRONLY
        attempt("dir_fd", lambda: os.open({name!r}, flags, dir_fd=os.open({str(tmp_path)!r},
                                                                        os.O_RDONLY)))
        attempt("dotdot", lambda: os.open({name!r}, flags, dir_fd=os.open("..", os.O_RDONLY)))
        attempt("up", lambda: os.open("../{name}", flags, dir_fd=os.open(".", os.O_RDONLY)))
        attempt("open", lambda: open({above!r}, "w"))
        """)
        assert len(attempts(result)) == 4, result
        assert not (tmp_path / name).exists() and not os.path.exists(parent) \
            and not os.path.exists(above), result.stdout
        assert not [a for a in attempts(result) if a.startswith("ok")], result.stdout
    finally:
        for path in (tmp_path / name, parent, above):
            if os.path.exists(path):
                os.remove(path)


@every_variant
def test_mkfifo_and_mknod_make_nothing_outside(variant, tmp_path):
    """os.mkfifo raises no audit event: the hook never saw it."""
    result = run(variant, f"""
    import os, stat
    attempt("mkfifo", lambda: os.mkfifo({str(tmp_path / "fifo")!r}))
    attempt("mknod", lambda: os.mknod({str(tmp_path / "node")!r}, 0o600 | stat.S_IFREG))
    attempt("device", lambda: os.mknod("null2", 0o666 | stat.S_IFCHR, os.makedev(1, 3)))
    attempt("here", lambda: os.mkfifo("fifo"))  # a FIFO in the work directory may be made
    """)
    assert not (tmp_path / "fifo").exists() and not (tmp_path / "node").exists()
    outcomes = {line.split()[1]: line.split()[0] for line in attempts(result)}
    assert outcomes == {"mkfifo": "no", "mknod": "no", "device": "no", "here": "ok"}, result


@every_variant
def test_a_spawned_process_does_not_outlive_the_wall_limit(variant, tmp_path):
    """`_posixsubprocess.fork_exec` started a process with no audit event, in a new session
    (out of the killed process group), running as root (RLIMIT_NPROC does not bind)."""
    pid_file = tmp_path / "pid"
    code = f"""
    import _posixsubprocess, os, sys, time
    child = ("import os, time\\nwith open({str(pid_file)!r}, 'w') as f:\\n"
             "    f.write(str(os.getpid()))\\ntime.sleep(120)")
    def spawn():  # stdio on a file: holding the run's pipes, it would hold up the run
        errpipe_read, errpipe_write = os.pipe()
        null = os.open("spawned.log", os.O_RDWR | os.O_CREAT)
        args = [sys.executable, "-c", child]
        return _posixsubprocess.fork_exec(args, [os.fsencode(sys.executable)], True, (), None,
                                          None, null, -1, -1, null, -1, null, errpipe_read,
                                          errpipe_write, True, True, -1, None, None, None, -1,
                                          None, False)  # Python 3.11's 23 arguments
    if not attempt("fork_exec", spawn):
        raise SystemExit(0)
    for _ in range(400):  # its pid file, where it could write one
        if os.path.exists({str(pid_file)!r}):
            print("spawned", flush=True)
            break
        time.sleep(0.05)
    while True:
        pass
    """
    try:
        result = run(variant, code, wall_s=5.0)
        assert result.status == "timeout" or result.stdout.startswith("no fork_exec"), result
        survivor = int(pid_file.read_text()) if pid_file.exists() and pid_file.read_text() \
            else None
        assert survivor is None or not alive(survivor), \
            f"process {survivor} outlived the run: {result.stdout}"
    finally:
        if pid_file.exists() and pid_file.read_text() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@every_variant
def test_a_forked_process_in_its_own_session_dies_with_the_run(variant):
    """A fork that leaves the process group (setsid) escapes a process-group kill; inside a PID
    namespace it dies with the namespace's init. Found by the parent pid on its command line."""
    result = run(variant, """
    import os, time
    def fork():
        pid = os.fork()
        if pid == 0:
            os.setsid()
            while True:
                time.sleep(0.05)
        return pid
    if not attempt("fork", fork):
        raise SystemExit(0)
    while True:
        pass
    """, wall_s=3.0)
    assert result.status == "timeout" or result.stdout.startswith("no fork"), result
    assert _wait_until(lambda: not sandbox_processes()), sandbox_processes()


@every_variant
def test_signalling_the_parent_kills_nothing(variant):
    """`os.kill(os.getppid(), SIGKILL)` from a tool call killed the training driver. Here the
    driver is a disposable process running the sandbox, which must live to print its result."""
    script = textwrap.dedent(f"""
        import asyncio, json, sys
        sys.path[:0] = {sys.path!r}
        from tests.faults.test_sandbox_escapes import sandbox
        import pytest
        try:
            box = sandbox({variant!r})
        except pytest.skip.Exception as exc:
            print("SKIP", exc)
            raise SystemExit(0)
        code = "import os, signal\\nos.kill(os.getppid(), signal.SIGKILL)\\nprint('sent')"
        result = asyncio.run(box.run(code))
        print("ALIVE", json.dumps([result.status, result.stdout, result.error]))
        """)
    _survives(script)


def _survives(script: str) -> subprocess.CompletedProcess:
    """Run `script` as a sandbox's driver in a process of its own (skipped where it printed
    SKIP) and check that the driver lived to print ALIVE."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__)))))
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout[5:].strip())
    assert done.returncode == 0 and "ALIVE" in done.stdout, \
        f"the sandbox's parent ended with {done.returncode}: {done.stdout[-600:]} " \
        f"{done.stderr[-400:]}"
    return done


SIGIO_ATTACK = """
import fcntl, os, struct
parent = os.getppid()
attempt("F_SETOWN", lambda: fcntl.fcntl(1, fcntl.F_SETOWN, parent))
attempt("F_SETOWN_EX", lambda: fcntl.fcntl(1, 15, struct.pack("ii", 1, parent)))  # F_OWNER_PID
attempt("F_SETSIG", lambda: fcntl.fcntl(1, 10, 9))  # SIGKILL instead of SIGIO
attempt("FIOSETOWN", lambda: fcntl.ioctl(1, 0x8901, struct.pack("i", parent)))
attempt("O_ASYNC", lambda: fcntl.fcntl(1, fcntl.F_SETFL, fcntl.fcntl(1, fcntl.F_GETFL)
                                       | os.O_ASYNC))
attempt("FIOASYNC", lambda: fcntl.ioctl(1, 0x5452, struct.pack("i", 1)))
attempt("kill", lambda: os.kill(parent, 9))
for _ in range(64):  # each write to the pipe would signal its owner
    print("x" * 1024, flush=True)
"""


@pytest.mark.parametrize("variant", ["default", "nohook", "none", "seccomp", "fallback"])
def test_sigio_to_the_driver_kills_nothing(variant):
    """Defect 4 of issue 32: in `isolation: none` (and `auto` where it falls back to it) code
    made the driver the owner of its stdout (`fcntl F_SETOWN getppid()`), chose SIGKILL for
    it (`F_SETSIG 9`), set O_ASYNC and wrote: the driver died with 137. In namespaces the
    parent is the sandbox's own init. `seccomp` is isolation none with the audit hook off
    (the filter alone); `fallback` is `auto` where the probe failed."""
    script = textwrap.dedent(f"""
        import asyncio, json, logging, sys
        sys.path[:0] = {sys.path!r}
        logging.basicConfig()
        from eddyrl.envs.sandbox import runner
        from tests.faults.test_sandbox_escapes import SIGIO_ATTACK, TRY, sandbox
        import pytest
        variant = {variant!r}
        if variant == "fallback":
            runner._SUPPORT[sys.executable] = runner.Support(False, "failed for the test")
        try:
            box = sandbox("default" if variant == "fallback" else variant)
        except pytest.skip.Exception as exc:
            print("SKIP", exc)
            raise SystemExit(0)
        print("MODE", asyncio.run(box.mode()), flush=True)
        result = asyncio.run(box.run(TRY + SIGIO_ATTACK))
        print("ALIVE", json.dumps([result.status, result.error]))
        print(result.stdout, flush=True)
        """)
    done = _survives(script)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "no "))]
    assert [line.split()[:2] for line in lines] == [
        ["no", name] for name in ("F_SETOWN", "F_SETOWN_EX", "F_SETSIG", "FIOSETOWN",
                                  "O_ASYNC", "FIOASYNC", "kill")], done.stdout[:2000]
    if variant == "fallback":  # said, not silent
        assert "MODE none" in done.stdout and "fell back to 'none'" in done.stderr, done.stderr


def test_without_the_filter_the_sandbox_says_what_is_not_isolated(tmp_path, monkeypatch,
                                                                   caplog):
    """Issue 32: where there is no seccomp filter (an architecture without one, simulated
    with `setarch i686`; or prctl refused), `none` dropped signals, processes and sockets to
    the audit hook alone, silently."""
    import shutil

    from eddyrl.envs.sandbox import runner

    if shutil.which("setarch") is None or os.uname().machine != "x86_64":
        pytest.skip("needs setarch on x86_64 to run the child as i686")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec setarch i686 {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setattr(runner, "_WARNED", set())
    box = PythonSandbox(SandboxLimits(**LIMITS), str(python), isolation="none")
    with caplog.at_level("WARNING", logger=runner.__name__):
        result = asyncio.run(box.run("import os; print(os.uname().machine)"))
    assert result.stdout == "i686\n", result
    warned = [r.getMessage() for r in caplog.records if "seccomp filter" in r.getMessage()]
    assert len(warned) == 1 and "i686" in warned[0] and "isolation 'none'" in warned[0] \
        and "signal other processes (the training driver included)" in warned[0], warned


@every_variant
def test_another_process_cannot_be_signalled(variant):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        result = run(variant, f"""
        import os, signal
        attempt("kill", lambda: os.kill({victim.pid}, signal.SIGKILL))
        attempt("killpg", lambda: os.killpg({victim.pid}, signal.SIGKILL))
        """)
        assert victim.poll() is None, f"the victim was killed: {result.stdout}"
        assert [a.split()[0] for a in attempts(result)] == ["no", "no"], result
    finally:
        victim.kill()
        victim.wait()


@every_variant
def test_files_outside_the_work_directory_cannot_be_read(variant, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    paths = [str(secret), "/etc/hostname", "/etc/passwd", "/proc/1/root/etc/hostname",
             os.path.abspath(__file__), os.path.join(sys.prefix, "pyvenv.cfg")]
    result = run(variant, f"""
    import os
    for path in {paths!r}:
        attempt(path, lambda: open(path).read())
    attempt("listdir", lambda: os.listdir({str(tmp_path)!r}))
    attempt("dir_fd", lambda: os.open("secret.txt", os.O_RDONLY,
                                      dir_fd=os.open({str(tmp_path)!r}, os.O_RDONLY)))
    """)
    assert "s3cr3t" not in result.stdout
    got = [a for a in attempts(result) if a.startswith("ok")]
    assert len(attempts(result)) == len(paths) + 2 and not got, result.stdout


@every_variant
def test_no_connection_reaches_the_host_even_without_the_hook(variant):
    """A TCP listener on 127.0.0.1 and an abstract Unix socket (scoped to the network
    namespace) in this process; the code connects through `_socket` directly."""
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    name = f"\0eddy-sandbox-test-{uuid.uuid4().hex}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(name)
    unix.listen(8)
    unix.setblocking(False)
    try:
        result = run(variant, f"""
        import _socket
        def connect(family, address):
            s = _socket.socket(family, _socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(address)
            return s
        attempt("tcp", lambda: connect(_socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]})))
        attempt("unix", lambda: connect(_socket.AF_UNIX, {name!r}))
        attempt("udp", lambda: _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM).sendto(
            b"x", ("127.0.0.1", {tcp.getsockname()[1]})))
        """)
        for listener in (tcp, unix):
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing connected
        assert [a.split()[0] for a in attempts(result)] == ["no"] * 3, result.stdout
    finally:
        tcp.close()
        unix.close()


@pytest.mark.parametrize("variant", ["default", "nohook", "userns"])
def test_the_code_runs_unprivileged_in_its_own_namespaces(variant):
    """What the code sees of itself: no capabilities, no new privileges, the seccomp filter,
    PID 2 under an init, nobody (as root), a host name of its own, only a down loopback."""
    if variant == "default":
        support = getattr(python_tool, "namespace_support", None)
        if support is None or not support().ok:
            pytest.skip("namespaces are not available here")
    result = run(variant, """
    import os
    status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines())
    print(status["CapEff"], status["CapPrm"], status["CapBnd"], status["NoNewPrivs"],
          status["Seccomp"], os.getpid(), os.getppid(), os.getuid(), os.uname().nodename)
    attempt("proc", lambda: sorted(os.listdir("/proc")))
    """)
    caps, perm, bounding, no_new_privs, seccomp, pid, ppid, uid, host = \
        result.stdout.splitlines()[0].split()
    assert (caps, perm, bounding) == ("0" * 16,) * 3, result
    assert (no_new_privs, pid, ppid, host) == ("1", "2", "1", "sandbox"), result
    assert seccomp == ("2" if os.uname().machine in ("x86_64", "aarch64") else "0")
    assert uid == ("65534" if variant != "userns" and os.geteuid() == 0 else str(os.geteuid()))
    if variant == "nohook":  # only this PID namespace's processes
        assert attempts(result) == ["ok proc ['1', '2', 'self', 'thread-self']"], result


def test_seccomp_refuses_processes_exec_and_namespaces_without_the_hook():
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the seccomp filter is for x86_64 and aarch64 only")
    result = run("nohook", """
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    attempt("fork", os.fork)
    attempt("exec", lambda: os.execv("/usr/lib/os-release", ["x"]))
    attempt("unshare", lambda: libc.unshare(0x10000000) and ctypes.get_errno())  # CLONE_NEWUSER
    attempt("ptrace", lambda: libc.ptrace(0, 0, 0, 0) and ctypes.get_errno())  # TRACEME
    attempt("memfd", lambda: os.memfd_create("x"))
    import resource  # lowering a limit, which the kernel allows: refused (EPERM)
    attempt("rlimit", lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    import threading
    t = threading.Thread(target=print, args=("thread",))
    t.start(); t.join()
    """)
    lines = attempts(result)
    assert [line.split()[:2] for line in lines[:2]] == [["no", "fork"], ["no", "exec"]]
    assert lines[2] == "ok unshare 1" and lines[3] == "ok ptrace 1", result.stdout  # EPERM
    assert [line.split()[:3] for line in lines[4:6]] == [["no", "memfd", "PermissionError"],
                                                         ["no", "rlimit", "ValueError"]]
    assert "not allowed" in lines[5], result.stdout  # Python's word for EPERM here
    assert "thread" in result.stdout.splitlines(), result  # threads still start


def _wait_until(predicate, bound_s=30.0):
    """Poll for an event, with a generous bound (a killed process can take a moment to go)."""
    import time

    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True

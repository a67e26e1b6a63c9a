"""The sandboxed Python tool. Each run is a real subprocess (~50 ms; the first also probes
for namespaces); the limit tests are sized to stay under 5 s together. The tests that take an
`isolation` run in both modes: `auto` (namespaces where the probe succeeds) and `none`. No
test reaches the network: the connection attempts aim at TEST-NET-1 (192.0.2.1, never
routed) and at a closed loopback port, and must be refused by the sandbox before any socket
exists. The escapes are in tests/faults/test_sandbox_escapes.py."""

import asyncio
import logging
import os
import sys
import time

import pytest

from eddyrl.envs import Action, EnvConfig
from eddyrl.envs.python_tool import (PythonEnv, PythonSandbox, SandboxLimits,
                                     SandboxUnavailable)
from eddyrl.envs.sandbox import runner
from eddyrl.errors import ConfigError

from sandbox_processes import alive, sandbox_processes

# A wall limit far above any run's time: on a loaded machine starting an interpreter alone can
# take seconds, and only the tests of the wall limit itself may depend on it.
FAST = SandboxLimits(wall_s=60.0, cpu_s=5, memory_bytes=256 << 20, file_bytes=4096,
                     output_bytes=512)


def run(code, limits=FAST, isolation="auto"):
    return asyncio.run(PythonSandbox(limits, isolation=isolation).run(code))


@pytest.fixture(params=["auto", "none"])
def isolation(request):
    return request.param


def test_prints_output(isolation):
    result = run("print('hi', 6 * 7)", isolation=isolation)
    assert (result.status, result.stdout, result.returncode, result.error) == \
        ("success", "hi 42\n", 0, None)
    assert result.output() == "hi 42\n"


def test_exception_is_a_failure_with_the_traceback_tail(isolation):
    result = run("print('before')\ndef f(x):\n    return x / 0\nf(1)", isolation=isolation)
    assert result.status == "failure"
    assert result.error == "ZeroDivisionError: division by zero"
    assert 'File "<tool>", line 3, in f' in result.stderr
    assert "return x / 0" in result.stderr  # the model sees its own line
    assert "bootstrap" not in result.stderr and "exec(" not in result.stderr
    assert "<sandbox>" not in result.stderr and "eddyrl" not in result.stderr
    assert result.output().startswith("before\nTraceback")


def test_syntax_error_and_exit_status(isolation):
    assert run("def (", isolation=isolation).error.startswith("SyntaxError")
    result = run("import sys; sys.exit(3)", isolation=isolation)
    assert (result.status, result.returncode, result.error) == ("failure", 3, "exit code 3")
    assert run("raise SystemExit(0)", isolation=isolation).status == "success"
    result = run("import sys; sys.exit('bye')", isolation=isolation)
    assert (result.returncode, result.stderr) == (1, "bye\n")


def test_threads_atexit_and_the_main_module(isolation):
    """The run ends as an interpreter would: threads joined, atexit handlers run, and the
    code's module is __main__ (dataclasses and pickle look their classes up there)."""
    code = ("import atexit, dataclasses, pickle, sys, threading\n"
            "atexit.register(print, 'atexit')\n"
            "go = threading.Event()\n"
            "threading.Thread(target=lambda: (go.wait(), print('thread'))).start()\n"
            "@dataclasses.dataclass\nclass P:\n    x: int\n"
            "print(pickle.loads(pickle.dumps(P(1))), sys.modules['__main__'].P is P)\n"
            "go.set()  # the thread prints after the code's end, before atexit")
    result = run(code, isolation=isolation)
    assert result.stdout.splitlines() == ["P(x=1) True", "thread", "atexit"], result


def test_infinite_loop_times_out_within_the_wall_limit(isolation):
    """The wall limit ends it (no bound on the elapsed time: a loaded machine stretches it)."""
    result = run("while True:\n    pass", SandboxLimits(wall_s=0.5), isolation)
    assert result.status == "timeout" and "wall time" in result.error


def test_cpu_limit_stops_a_busy_loop(isolation):
    """RLIMIT_CPU ends it (SIGXCPU, relayed through the namespace's init), long before the
    wall limit: no bound on the elapsed time, which a loaded machine stretches."""
    result = run("print('start', flush=True)\nwhile True:\n    pass",
                 SandboxLimits(wall_s=120.0, cpu_s=1), isolation)
    assert result.status == "timeout" and "CPU time limit" in result.error
    assert result.stdout == "start\n"  # output before the kill is kept


def test_memory_bomb_is_a_memory_error_not_a_host_oom(isolation):
    result = run("x = bytearray(4 << 30)", isolation=isolation)
    assert (result.status, result.error) == ("failure", "MemoryError")
    result = run("x = []\nwhile True:\n    x.append(' ' * (1 << 20))", isolation=isolation)
    assert (result.status, result.error) == ("failure", "MemoryError")


@pytest.mark.parametrize("code, event", [
    ("import socket\nsocket.create_connection(('192.0.2.1', 9), timeout=0.05)",
     "socket.getaddrinfo"),
    ("import socket\ns = socket.socket()\ns.settimeout(0.05)\ns.connect(('127.0.0.1', 9))",
     "socket.__new__"),
    ("import urllib.request\nurllib.request.urlopen('http://192.0.2.1:9/', timeout=0.05)",
     "socket.getaddrinfo"),
])
def test_network_is_refused_before_any_socket(code, event, isolation):
    result = run(code, isolation=isolation)
    assert result.status == "failure"
    assert f"sandbox: {event} refused" in result.error


@pytest.mark.parametrize("code, event", [
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.fork()", "os.fork"),
    ("import ctypes", "ctypes.dlopen"),
])
def test_no_child_processes_or_native_calls(code, event, isolation):
    result = run(code, isolation=isolation)
    assert result.status == "failure" and f"sandbox: {event} refused" in result.error


def test_clean_environment(monkeypatch, isolation):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("SECRET_TOKEN", "x")
    result = run("import os\nprint(sorted(os.environ))", isolation=isolation)
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR']\n"


def test_writes_are_confined_to_a_fresh_directory_and_size_limited(tmp_path, isolation):
    outside = tmp_path / "escape.txt"
    result = run(f"open({str(outside)!r}, 'w').write('x')", isolation=isolation)
    assert "writing" in result.error and "refused" in result.error
    assert not outside.exists()
    result = run(f"import os\nos.remove({str(tmp_path)!r})", isolation=isolation)
    assert "os.remove" in result.error
    code = ("import os\nprint(os.getcwd())\nwith open('a.txt', 'w') as f:\n    f.write('x' * 100)"
            "\nprint(os.path.getsize('a.txt'))\ntry:\n    with open('b.txt', 'w') as f:"
            "\n        f.write('x' * 10000)\nexcept OSError as e:\n    print(e.strerror)"
            "\nprint(os.path.getsize('b.txt'))")
    result = run(code, isolation=isolation)
    workdir, small, error, big = result.stdout.splitlines()
    assert (small, error, big) == ("100", "File too large", "4096")
    assert os.path.basename(workdir).startswith("eddy-python-")
    assert not os.path.exists(workdir)  # removed after the run


def test_the_work_directory_is_a_bounded_tmpfs_with_namespaces():
    """All the files together are bounded too (a file-size limit alone lets a loop of files
    fill the host's disk): with namespaces the work directory is a tmpfs of workdir_bytes."""
    if not runner.namespace_support().ok:
        pytest.skip(f"namespaces are not available here: {runner.namespace_support().reason}")
    code = ("import os\ntry:\n    for i in range(100):\n"
            "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * 4096)\n"
            "except OSError as e:\n    print(e.strerror, i)")
    result = run(code, SandboxLimits(file_bytes=4096, workdir_bytes=40960), "namespaces")
    error, files = result.stdout.rsplit(" ", 1)
    assert error == "No space left on device" and 5 <= int(files) <= 10, result


def test_output_is_capped_and_a_print_loop_cannot_fill_memory():
    # 20 MB of output, more than the cap by far, in a run that ends by itself
    result = run("for _ in range(20000):\n    print('x' * 1000)", SandboxLimits(output_bytes=100))
    assert result.status == "success" and result.truncated
    assert result.stdout == "x" * 100
    result = run("import sys\nsys.stderr.write('a' * 5000 + 'END')\nraise SystemExit(1)",
                 SandboxLimits(output_bytes=100))
    assert len(result.stderr) == 100 and result.stderr.endswith("END")  # the tail is kept


def test_code_size_is_limited():
    result = run("x = 1\n" * 100, SandboxLimits(code_bytes=50))
    assert result.status == "failure" and "600 bytes" in result.error


def test_runs_concurrently():
    """Two runs overlap: each prints when it started and ended, and each started before the
    other ended (run one after the other, the second would start after the first ended). No
    bound on elapsed time: on a busy machine that says nothing."""
    async def two():
        sandbox = PythonSandbox(SandboxLimits(wall_s=60.0, cpu_s=5, memory_bytes=256 << 20,
                                              file_bytes=4096, output_bytes=512))
        code = "import time\nstart = time.time()\ntime.sleep(2)\nprint(start, time.time())"
        return await asyncio.gather(sandbox.run(code), sandbox.run(code))

    (start1, end1), (start2, end2) = [map(float, r.stdout.split()) for r in asyncio.run(two())]
    assert start2 < end1 and start1 < end2


def test_cancelled_run_leaves_no_process(isolation):
    """Cancelled while its code runs (seen in /proc, waited for with a generous bound, not a
    sleep), the run leaves none of its processes (the launcher, the init, the code)."""
    async def scenario():
        sandbox = PythonSandbox(SandboxLimits(wall_s=60.0), isolation=isolation)
        task = asyncio.ensure_future(sandbox.run("while True:\n    pass"))
        deadline = time.monotonic() + 30.0
        while len(processes := sandbox_processes()) < (3 if await sandbox.mode() ==
                                                        "namespaces" else 1):
            assert time.monotonic() < deadline and not task.done(), processes
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return processes

    processes = asyncio.run(scenario())
    deadline = time.monotonic() + 30.0  # the init and the code die with the process group
    while living := [pid for pid in processes if alive(pid)]:
        assert time.monotonic() < deadline, living
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{processes[0]}")  # the one we started: reaped




def test_python_env_answers_a_call_with_the_output(spy):
    env = PythonEnv(tokenizer=spy, prompt="p", answer="3",
                    sandbox=PythonSandbox(SandboxLimits(wall_s=120.0, cpu_s=1)))
    obs = asyncio.run(env.step(Action((1,), "<python>print(1 + 2)</python>")))
    assert spy.encoded == ["<output>3\n</output>"] and not obs.done
    assert (obs.tool.tool, obs.tool.status) == ("python", "success")
    obs = asyncio.run(env.step(Action((1,), "<python>while True: pass</python>")))
    # the CPU limit ends the loop (no wall-clock race on a loaded machine); a timeout costs a
    # turn, not the episode
    assert obs.tool.status == "timeout" and not obs.done
    assert "CPU time limit" in spy.encoded[-1]  # what the model is shown
    assert asyncio.run(env.step(Action((1,), "so = 3"))).reward == 1.0


def test_isolation_is_validated_naming_the_key(spy):
    with pytest.raises(ValueError, match="isolation = 'container' is not one of"):
        PythonSandbox(isolation="container")
    with pytest.raises(ConfigError, match=r"config key 'env.options.isolation' = 'nsjail'"):
        PythonEnv(tokenizer=spy, prompt="p", answer="a", isolation="nsjail")
    with pytest.raises(ConfigError, match=r"'env.options.isolation'"):
        EnvConfig(name="python", options={"isolation": "off"}).build(
            "env", tokenizer=spy, reward_fn="eddyrl.tasks.reward:reward")
    env = PythonEnv(tokenizer=spy, prompt="p", answer="a", isolation="none")
    assert env.sandbox.isolation == "none"


def test_without_namespaces_auto_warns_once_and_namespaces_refuses(monkeypatch, caplog):
    """The probe's answer decides: here it is made to fail."""
    monkeypatch.setitem(runner._SUPPORT, sys.executable,
                        runner.Support(False, "user namespaces are disabled (test)"))
    monkeypatch.setattr(runner, "_WARNED", set())
    with pytest.raises(SandboxUnavailable, match=r"'namespaces' is not available here: user "
                                                 r"namespaces are disabled \(test\)"):
        run("print(1)", isolation="namespaces")
    with caplog.at_level(logging.WARNING, logger=runner.__name__):
        assert [run("print(1)", isolation="auto").stdout for _ in range(2)] == ["1\n"] * 2
    warnings = [r.getMessage() for r in caplog.records if r.name == runner.__name__]
    assert len(warnings) == 1 and "user namespaces are disabled (test)" in warnings[0]
    assert "fell back to 'none'" in warnings[0]


@pytest.mark.integration  # the probe runs the sandbox (found by name for the others)
def test_the_probe_runs_once_and_says_why_it_failed():
    support = runner.namespace_support()
    assert runner.namespace_support() is support  # cached
    broken = runner._probe("/nonexistent/python")
    assert not broken.ok and "/nonexistent/python" in broken.reason


def test_a_setup_failure_is_an_error_not_the_code_s_failure(monkeypatch):
    """A sandbox that cannot start raises (the episode is cut), rather than showing the model
    an error of its own."""
    if not runner.namespace_support().ok:
        pytest.skip(f"namespaces are not available here: {runner.namespace_support().reason}")
    monkeypatch.setattr(runner, "_layout", lambda base, mode, limits: (base, base + "/none",
                                                                       "1000000"))
    with pytest.raises(runner.SandboxError, match="could not start: isolating the interpreter"):
        run("print(1)", isolation="namespaces")


def test_another_interpreter_gets_the_source_not_the_marshalled_code(isolation):
    """child.py's code object goes only to this same interpreter; another (a `python=` of
    another version) gets its source with -c."""
    sandbox = PythonSandbox(FAST, isolation=isolation)
    sandbox._same = False
    result = asyncio.run(sandbox.run("import sys\nprint(sys.argv)"))
    assert (result.status, result.stdout) == ("success", "['<tool>']\n"), result

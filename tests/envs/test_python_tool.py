"""The sandboxed Python tool. Each run is a real subprocess (~30 ms); the limit tests are
sized to stay under 5 s together. No test reaches the network: the connection attempts aim
at TEST-NET-1 (192.0.2.1, never routed) and at a closed loopback port, and must be refused
by the sandbox before any socket exists."""

import asyncio
import os
import time

import pytest

from eddyrl.envs import Action
from eddyrl.envs.python_tool import PythonEnv, PythonSandbox, SandboxLimits

FAST = SandboxLimits(wall_s=1.0, cpu_s=5, memory_bytes=256 << 20, file_bytes=4096,
                     output_bytes=512)


def run(code, limits=FAST):
    return asyncio.run(PythonSandbox(limits).run(code))


def test_prints_output():
    result = run("print('hi', 6 * 7)")
    assert (result.status, result.stdout, result.returncode, result.error) == \
        ("success", "hi 42\n", 0, None)
    assert result.output() == "hi 42\n"


def test_exception_is_a_failure_with_the_traceback_tail():
    result = run("print('before')\ndef f(x):\n    return x / 0\nf(1)")
    assert result.status == "failure"
    assert result.error == "ZeroDivisionError: division by zero"
    assert 'File "<tool>", line 3, in f' in result.stderr
    assert "return x / 0" in result.stderr  # the model sees its own line
    assert "bootstrap" not in result.stderr and "exec(" not in result.stderr
    assert result.output().startswith("before\nTraceback")


def test_syntax_error_and_exit_status():
    assert run("def (").error.startswith("SyntaxError")
    result = run("import sys; sys.exit(3)")
    assert (result.status, result.returncode, result.error) == ("failure", 3, "exit code 3")
    assert run("raise SystemExit(0)").status == "success"


def test_infinite_loop_times_out_within_the_wall_limit():
    start = time.monotonic()
    result = run("while True:\n    pass", SandboxLimits(wall_s=0.5))
    assert result.status == "timeout" and "wall time" in result.error
    assert time.monotonic() - start < 1.5


def test_cpu_limit_stops_a_busy_loop():
    result = run("print('start', flush=True)\nwhile True:\n    pass",
                 SandboxLimits(wall_s=5.0, cpu_s=1))
    assert result.status == "timeout" and "CPU time limit" in result.error
    assert result.stdout == "start\n"  # output before the kill is kept
    assert result.seconds < 3.0


def test_memory_bomb_is_a_memory_error_not_a_host_oom():
    result = run("x = bytearray(4 << 30)")
    assert (result.status, result.error) == ("failure", "MemoryError")
    result = run("x = []\nwhile True:\n    x.append(' ' * (1 << 20))")
    assert (result.status, result.error) == ("failure", "MemoryError")


@pytest.mark.parametrize("code, event", [
    ("import socket\nsocket.create_connection(('192.0.2.1', 9), timeout=0.05)",
     "socket.getaddrinfo"),
    ("import socket\ns = socket.socket()\ns.settimeout(0.05)\ns.connect(('127.0.0.1', 9))",
     "socket.__new__"),
    ("import urllib.request\nurllib.request.urlopen('http://192.0.2.1:9/', timeout=0.05)",
     "socket.getaddrinfo"),
])
def test_network_is_refused_before_any_socket(code, event):
    result = run(code)
    assert result.status == "failure"
    assert f"sandbox: {event} refused" in result.error


@pytest.mark.parametrize("code, event", [
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.fork()", "os.fork"),
    ("import ctypes", "ctypes.dlopen"),
])
def test_no_child_processes_or_native_calls(code, event):
    result = run(code)
    assert result.status == "failure" and f"sandbox: {event} refused" in result.error


def test_clean_environment(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("SECRET_TOKEN", "x")
    result = run("import os\nprint(sorted(os.environ))")
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR']\n"


def test_writes_are_confined_to_a_fresh_directory_and_size_limited(tmp_path):
    outside = tmp_path / "escape.txt"
    result = run(f"open({str(outside)!r}, 'w').write('x')")
    assert "writing" in result.error and "refused" in result.error
    assert not outside.exists()
    result = run(f"import os\nos.remove({str(tmp_path)!r})")
    assert "os.remove" in result.error
    code = ("import os\nprint(os.getcwd())\nwith open('a.txt', 'w') as f:\n    f.write('x' * 100)"
            "\nprint(os.path.getsize('a.txt'))\ntry:\n    with open('b.txt', 'w') as f:"
            "\n        f.write('x' * 10000)\nexcept OSError as e:\n    print(e.strerror)"
            "\nprint(os.path.getsize('b.txt'))")
    result = run(code)
    workdir, small, error, big = result.stdout.splitlines()
    assert (small, error, big) == ("100", "File too large", "4096")
    assert os.path.basename(workdir).startswith("eddy-python-")
    assert not os.path.exists(workdir)  # removed after the run


def test_output_is_capped_and_a_print_loop_cannot_fill_memory():
    result = run("while True:\n    print('x' * 1000)", SandboxLimits(wall_s=0.3,
                                                                   output_bytes=100))
    assert result.status == "timeout" and result.truncated
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


def test_cancelled_run_leaves_no_process():
    async def scenario():
        sandbox = PythonSandbox(SandboxLimits(wall_s=5.0))
        task = asyncio.ensure_future(sandbox.run("while True:\n    pass"))
        await asyncio.sleep(0.3)
        children = [pid for pid in os.listdir("/proc") if pid.isdigit() and _sandbox_child(pid)]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return children

    children = asyncio.run(scenario())
    assert len(children) == 1
    assert not os.path.exists(f"/proc/{children[0]}")  # killed and reaped


def _sandbox_child(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return False
    return ppid == os.getpid() and b"RLIMIT_AS" in cmd


def test_python_env_answers_a_call_with_the_output(spy):
    env = PythonEnv(tokenizer=spy, prompt="p", answer="3",
                    sandbox=PythonSandbox(SandboxLimits(wall_s=0.3)))
    obs = asyncio.run(env.step(Action((1,), "<python>print(1 + 2)</python>")))
    assert spy.encoded == ["<output>3\n</output>"] and not obs.done
    assert (obs.tool.tool, obs.tool.status) == ("python", "success")
    obs = asyncio.run(env.step(Action((1,), "<python>while True: pass</python>")))
    assert obs.tool.status == "timeout" and not obs.done  # a timeout costs a turn, not the episode
    assert "timed out" in spy.encoded[-1]
    assert asyncio.run(env.step(Action((1,), "so = 3"))).reward == 1.0

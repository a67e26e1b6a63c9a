"""`eddy train` as a user runs it, in a process of its own, for the faults done to it from outside
(a signal, a killed Ray process): start it, wait for a point in the run, find its processes.

Every wait is for an event with a generous bound; none asserts that something was quick."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

TESTS = Path(__file__).resolve().parent  # tests/support: reward_fixtures
# long enough never to finish before the fault; each step checkpointed, so a stop can resume
RUN = ["loop.steps=100", "loop.batch_prompts=4", "loop.eval_every=0", "rollout.n_samples=4",
       "rollout.max_new_tokens=16", "data.train_size=64", "data.eval_size=4",
       "cluster.threads_per_worker=1", "data.reward_fn=reward_fixtures:length_reward",
       "checkpoint.every=1"]
START_S = 600  # Ray and the workers start, step 1 trains: minutes on a loaded 2-core machine
END_S = 180  # the run ends after the fault (a stop, an error): well past what it takes


# `eddy` as `python -m eddyrl.cli` runs it, taking Ctrl-C as a terminal gives it: a test run
# started in the background by a non-interactive shell ignores SIGINT, and so would its children
# (found so: every SIGINT test failed in such a run, and passed in the foreground).
_CLI = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from eddyrl.cli import main\nsys.exit(main(sys.argv[1:]))")


def start(model_dir: str, run_dir: Path, *overrides: str, env: dict | None = None
          ) -> subprocess.Popen:
    python_path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-c", _CLI, "train", f"model.path={model_dir}",
         f"run_dir={run_dir}", *RUN, *overrides],
        stdout=open(run_dir.parent / f"{run_dir.name}.out", "w"),
        stderr=open(run_dir.parent / f"{run_dir.name}.err", "w"),
        cwd=run_dir.parent, env={**os.environ, "EDDY_PLATFORM": "cpu", "PYTHONPATH": python_path,
                                 **(env or {})})


@contextlib.contextmanager
def running(model_dir: str, run_dir: Path, ready=None, what: str = "a checkpoint",
            overrides: tuple[str, ...] = ()):
    """`eddy train` (with `overrides`) started and waited for until `ready()` (default: its
    first checkpoint); yields the driver and its process tree at that moment; afterwards both
    are killed by PID, whatever the test did."""
    driver = start(model_dir, run_dir, *overrides)
    processes: dict[int, tuple[float, str]] = {}
    try:
        wait_until(driver, run_dir, ready or (lambda: checkpointed(run_dir)), what)
        processes = tree(driver.pid)
        yield driver, processes
    finally:
        driver.kill()
        kill_all(processes)


def stderr_of(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.err").read_text()


def wait_until(process: subprocess.Popen, run_dir: Path, ready, what: str) -> None:
    """Until `ready()`; the run ending first, or START_S passing, fails the test."""
    deadline = time.monotonic() + START_S
    while not ready():
        if process.poll() is not None:
            raise AssertionError(f"eddy train ended (rc {process.returncode}) before {what}:\n"
                                 + stderr_of(run_dir)[-3000:])
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {what} within {START_S} s:\n" + stderr_of(run_dir)[-3000:])
        time.sleep(0.5)


def checkpointed(run_dir: Path) -> bool:
    """Step 1 is logged and its checkpoint is in place (renamed into place: complete)."""
    return any((run_dir / "checkpoints").glob("step_*"))


def finish(process: subprocess.Popen, run_dir: Path) -> int:
    try:
        return process.wait(timeout=END_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"eddy train still ran {END_S} s after the fault:\n"
                             + stderr_of(run_dir)[-3000:]) from None


def tree(pid: int) -> dict[int, tuple[float, str]]:
    """The processes under `pid` (Ray's GCS, raylet, agents and workers for a driver that
    started a local Ray): pid -> (start time, name); a PID is the same process only with the
    same start time."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            found[child.pid] = (child.create_time(), child.name())
        except psutil.NoSuchProcess:
            pass
    return found


def alive(processes: dict[int, tuple[float, str]]) -> dict[int, str]:
    """Which of `processes` still run (a zombie has ended: only its exit status is left)."""
    living = {}
    for pid, (started, name) in processes.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                living[pid] = name
        except psutil.NoSuchProcess:
            pass
    return living


def wait_gone(processes: dict[int, tuple[float, str]], bound_s: float) -> dict[int, str]:
    """Poll until none of `processes` runs, or `bound_s` passed; what still runs then."""
    deadline = time.monotonic() + bound_s
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(processes)


def kill_all(processes: dict[int, tuple[float, str]]) -> None:
    """Clean-up after a failed test: the processes it recorded, by PID, nothing else."""
    for pid in alive(processes):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_to_the_end(model_dir: str, run_dir: Path, *overrides: str, faults: str = "",
                   fired: Path) -> tuple[int, str]:
    """`eddy train` with `faults` at their points (`eddyrl/fault_points.py`; `fired`: the
    directory of their once-markers) run to its end: its exit code and stderr. Its processes
    are killed by PID afterwards, whatever happened."""
    driver = start(model_dir, run_dir, *overrides,
                   env={"EDDY_FAULT_POINTS": faults, "EDDY_FAULT_POINTS_FIRED": str(fired)})
    processes: dict[int, tuple[float, str]] = {}
    try:
        wait_until(driver, run_dir, lambda: (run_dir / "placement.json").exists(),
                   "the workers' start")
        processes = tree(driver.pid)
        rc = finish(driver, run_dir)
    finally:
        driver.kill()
        kill_all(processes)
    return rc, stderr_of(run_dir)

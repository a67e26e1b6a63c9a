"""The local Ray a run starts, and its end (issue 19): a killed driver leaves none of the Ray
session's processes behind (its agents used to live on for a minute, one listening); a killed
GCS or raylet ends the run at once with one line naming it and resume=auto (a killed GCS used to
let training go on for 60 s, then Ray killed the driver without a word; a killed raylet was
blamed on whichever trainer call was in flight); the session's auth token is its own (Ray's
default, ~/.ray/auth_token, is 0644 and shared by every cluster of the user); RAY_ADDRESS in the
environment of a local run is one line, not a traceback.

Every process is identified by PID (and start time) under the driver, never by name across the
machine."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

import eddy_process as run

# Ray's agents outlived the killed driver by a minute (their calls to the dead GCS time out at
# 60 s); the reaper kills them within a second. Half of Ray's minute is ample for that.
GONE_S = 30
RAY = ("cluster.runtime=ray",)  # the default job would run in one process, without Ray


@pytest.mark.slow
def test_a_killed_driver_leaves_no_ray_process(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"

    def step_1_logged():
        metrics = run_dir / "metrics.jsonl"
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 2

    with run.running(tiny_model_dir, run_dir, step_1_logged, "step 1's metrics",
                     overrides=RAY) as (driver, processes):
        names = {name for _, name in processes.values()}
        assert {"gcs_server", "raylet"} <= names, names
        assert any(name.startswith("ray::") for name in names), names  # agents, workers
        (gcs,) = [pid for pid, (_, name) in processes.items() if name == "gcs_server"]
        token = psutil.Process(gcs).environ()["RAY_AUTH_TOKEN_PATH"]
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=run.END_S)
        left = run.wait_gone(processes, GONE_S)
        assert not left, f"still running {GONE_S} s after the driver was killed: {left}"
        assert not os.path.exists(token)  # the run's token goes with it


@pytest.mark.slow
@pytest.mark.parametrize("victim, name", [("gcs_server", "GCS server"), ("raylet", "raylet")])
def test_a_killed_gcs_or_raylet_ends_the_run_with_one_line(tiny_model_dir, tmp_path, victim,
                                                           name):
    run_dir = tmp_path / "run"
    with run.running(tiny_model_dir, run_dir, overrides=RAY) as (driver, processes):
        (pid,) = [p for p, (_, n) in processes.items() if n == victim]
        os.kill(pid, signal.SIGKILL)
        rc = run.finish(driver, run_dir)
        # the rest of the session goes too, the reaper last (it may have the last word)
        left = run.wait_gone(processes, GONE_S)
        assert not left, left
        err = run.stderr_of(run_dir)
        last = err.strip().splitlines()[-1]
        # 2 when the driver says it; Ray's own 1 when a lost raylet broke the driver's
        # connection to the object store first (Ray then ends it at once: the reaper says it)
        assert rc in (1, 2), err[-3000:]
        assert last.startswith(f"eddy: error: Ray's {name} ({victim}, pid {pid}) "), last
        assert ("was killed by SIGKILL" if rc == 2 else "died, and Ray ended the driver") \
            in last, last
        assert "resume=auto" in last, last
        assert "Traceback" not in err, err[-3000:]
        assert "trainer rank" not in last and "rollout worker" not in last, last


_DRIVER = textwrap.dedent("""
    import os, subprocess, sys, time
    reaper, logs, how = sys.argv[1:]
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if how == "plasma":  # what Ray's core worker logs as it ends a driver that lost its raylet
        with open(os.path.join(logs, f"python-core-driver-01ff_{os.getpid()}.log"), "w") as log:
            log.write("connection.cc:216: The connection to the plasma store is failed. "
                      "Terminate the process. Status: IOError: Broken pipe")
    read, write = os.pipe()
    token = os.path.join(logs, "eddy-ray-token-x")
    os.mkdir(token)
    subprocess.Popen([sys.executable, "-I", reaper, logs, token, f"raylet={raylet.pid}"],
                     stdin=read, start_new_session=True)
    os.close(read)
    print(raylet.pid, flush=True)
    time.sleep(1.5)  # the reaper reads the tree
    if how == "bye":
        os.write(write, b"bye\\n")
    os._exit(1)  # as Ray's core worker ends it, or a SIGKILL: no exit handler runs
""")


@pytest.mark.parametrize("how, says", [("plasma", True), ("bye", False), ("killed", False)])
def test_the_reaper_kills_the_tree_and_names_a_lost_raylet(tmp_path, how, says):
    """The reaper without Ray: a driver with one child (the "raylet") dies; the child is killed,
    the token directory removed, and the line printed only where the driver's Ray log says Ray
    ended it for that loss."""
    from eddyrl.runtime.ray import reaper as ray_reaper

    out = subprocess.run([sys.executable, "-c", _DRIVER, ray_reaper.__file__, str(tmp_path),
                          how], capture_output=True, text=True, timeout=120)
    raylet = int(out.stdout.split()[0])  # the reaper has ended: stderr closed, so it is done
    assert not psutil.pid_exists(raylet) or \
        psutil.Process(raylet).status() == psutil.STATUS_ZOMBIE
    assert not (tmp_path / "eddy-ray-token-x").exists()
    lines = [line for line in out.stderr.splitlines() if line.startswith("eddy: ")]
    if says:
        assert len(lines) == 1, out.stderr
        assert lines[0].startswith(f"eddy: error: Ray's raylet (raylet, pid {raylet}) died, and "
                                   "Ray ended the driver (pid "), lines
        assert "resume=auto" in lines[0], lines
    else:
        assert lines == [], out.stderr


# Two local Ray sessions, one after the other, as two runs of one user start them (in one
# process: the interpreter's start and imports paid once; each session is started and stopped
# whole, its token removed before the next begins)
_TOKEN_PROBE = textwrap.dedent("""
    import json, os, stat, sys
    import psutil, ray
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime.ray import start_ray, stop_ray

    for _ in range(2):
        start_ray(runtime_settings(load_config(overrides=["platform=cpu"])))
        path = os.environ.get("RAY_AUTH_TOKEN_PATH")
        gcs = ray._private.worker._global_node.all_processes["gcs_server"][0].process.pid
        seen = {"path": path,
                "gcs_path": psutil.Process(gcs).environ().get("RAY_AUTH_TOKEN_PATH"),
                "mode": path and stat.S_IMODE(os.stat(path).st_mode),
                "dir_mode": path and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode),
                "token": path and open(path).read()}
        stop_ray()
        seen["removed"] = bool(path) and not os.path.exists(os.path.dirname(path))
        seen["env_after"] = os.environ.get("RAY_AUTH_TOKEN_PATH")
        print(json.dumps(seen), flush=True)
""")


def _probe_tokens(home):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN",
                                                            "RAY_AUTH_TOKEN_PATH")}
    out = subprocess.run([sys.executable, "-c", _TOKEN_PROBE], capture_output=True, text=True,
                         timeout=300, env={**env, "HOME": str(home)})
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-2:]]


def test_a_local_run_has_a_private_token_of_its_own(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    first, second = _probe_tokens(home)
    for seen in (first, second):
        assert seen["path"], "no RAY_AUTH_TOKEN_PATH: Ray falls back to ~/.ray/auth_token"
        assert seen["gcs_path"] == seen["path"]  # the token Ray's own servers check
        assert seen["mode"] == 0o600 and seen["dir_mode"] == 0o700, seen
        assert len(seen["token"]) >= 32
        assert seen["removed"] and seen["env_after"] is None, seen
    assert first["token"] != second["token"]  # one per session, not one per user
    assert not (home / ".ray" / "auth_token").exists()  # Ray's shared default never written


def test_ray_address_in_the_environment_of_a_local_run_is_one_line(monkeypatch):
    from eddyrl.config import load_config
    from eddyrl.errors import ConfigError
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime.ray import start_ray

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    with pytest.raises(ConfigError, match=r"RAY_ADDRESS is set \('127.0.0.1:6379'\) but "
                                          r"cluster.address is not.*cluster.address=auto"):
        start_ray(runtime_settings(load_config(overrides=["platform=cpu"])))

"""Fault injection on the run directory (issue 19's defects 4 and 6, and its unclear answers
about run directories), with other processes and the tiny model: a second run is refused
naming the first and a dead one's lock is taken over, a read-only directory is one line,
`eddy train` checks before it writes (a refused resume changes nothing, an empty metrics file
of a failed start does not block a rerun), and `eddy eval` verifies a checkpoint first. Each
scenario is the probe's, replayed on files made here (run_dir_cases.py). (The rules on files
alone: test_run_directory_rules.py.)"""

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest

from eddyrl import checkpoints
from eddyrl.errors import ConfigError
from eddyrl.run_dir import LOCK, RunDirectory

from run_dir_cases import metrics, write


# -- the run directory: usable, locked ----------------------------------------------------------

HOLDER = ("import sys; from eddyrl.run_dir import RunDirectory; "
          "RunDirectory.claim(sys.argv[1]); print('held', flush=True); sys.stdin.read()")


def test_a_second_run_is_refused_naming_the_first_and_a_dead_ones_lock_is_taken_over(
        tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {holder.pid} "):
            RunDirectory.claim(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: no release
        holder.wait()
    with caplog.at_level(logging.WARNING):
        hold = RunDirectory.claim(tmp_path)
    assert f"pid {holder.pid}" in caplog.text and "ended without releasing" in caplog.text
    hold.release()
    assert (tmp_path / LOCK).read_text() == ""  # a clean release leaves no holder behind


def test_train_refuses_a_run_dir_another_run_holds_before_touching_it(tmp_path):
    """Before: two `eddy train run_dir=X` started together both ran, with interleaved
    metrics and the same checkpoint paths."""
    from eddyrl.config import load_config
    from eddyrl.launch import train

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        config = load_config(overrides=[f"run_dir={tmp_path}", "platform=cpu"])
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {holder.pid} "):
            train(config)
    finally:
        holder.stdin.close()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs root and unshare(1) for a read-only mount")
def test_a_read_only_run_dir_is_one_line(tmp_path):
    """A read-only file system (root ignores permission bits, so a real read-only mount in a
    private mount namespace)."""
    target = tmp_path / "ro"
    target.mkdir()
    code = ("import sys\nfrom eddyrl.errors import ConfigError\nfrom eddyrl.run_dir import "
            "RunDirectory\ntry:\n    RunDirectory.claim(sys.argv[1] + '/run')\nexcept "
            "ConfigError as e:\n    print(e)\n")
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount -t tmpfs -o ro tmpfs {target} && exec {sys.executable} "
                            f"-c \"$0\" {target}", code], capture_output=True, text=True)
    if probe.returncode != 0 and "mount" in probe.stderr:
        pytest.skip(f"no private read-only mount here: {probe.stderr.strip()}")
    assert probe.stdout.strip() == (f"run_dir '{target}/run' cannot be used: Read-only file "
                                    "system; choose a directory on a writable file system")


# -- defect 4 and friends: train() checks first, then writes ------------------------------------

@pytest.fixture
def run_with_checkpoint(tmp_path):
    """A run directory as a finished 3-step run leaves it, checkpoint at step 2 (seed 0)."""
    write(tmp_path, 2)
    metrics(tmp_path, range(4))
    (tmp_path / "config.yaml").write_text("seed: 0  # the run's own\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "the run\'s own"}\n')
    return tmp_path


def snapshot(run_dir):
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != LOCK}


def test_a_refused_resume_changes_nothing_in_the_run(run_with_checkpoint, tiny_model_dir):
    """Before: config.yaml got `seed: 1` and metrics.jsonl was cut before the seed and data
    were checked. Now each refusal leaves every file as it was."""
    from eddyrl.config import load_config
    from eddyrl.launch import train

    run_dir = run_with_checkpoint
    before = snapshot(run_dir)

    def refused(*overrides, match):
        config = load_config(overrides=[f"run_dir={run_dir}", "platform=cpu", "resume=auto",
                                        f"model.path={tiny_model_dir}", *overrides])
        with pytest.raises(ConfigError, match=match):
            train(config)
        assert snapshot(run_dir) == before

    refused("seed=1", match="config key 'seed' = 1 but the checkpoint was written with seed = 0")
    refused("loop.steps=1", match="'loop.steps' = 1 is below the step of the checkpoint")
    # the data is generated (into staging) and found to differ from the checkpoint's
    refused("loop.steps=4", match="training prompts differ from the checkpoint's")
    assert not (run_dir / ".staging").exists()


def test_an_empty_metrics_file_from_a_failed_start_does_not_block_a_rerun(
        tmp_path, tiny_model_dir, monkeypatch):
    """A start-up that failed after metrics.jsonl was made left it empty; before, the rerun
    was refused for 'holding a run'."""
    from eddyrl import launch
    from eddyrl.config import load_config

    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / LOCK).write_text("")  # a failed start claimed the directory first

    class Reached(Exception):
        pass

    def run(*args):
        raise Reached  # every check passed and the run's files were written

    monkeypatch.setattr(launch, "_run", run)
    config = load_config(overrides=[f"run_dir={tmp_path}", "platform=cpu",
                                    f"model.path={tiny_model_dir}", "data.train_size=8",
                                    "data.eval_size=4"])
    with pytest.raises(Reached):
        launch.train(config)
    assert not (tmp_path / "metrics.jsonl").exists()  # the fresh run starts its own
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "data" / "train.jsonl").is_file()
    assert (tmp_path / LOCK).read_text() == ""  # released on the way out


# -- defect 6: eddy eval verifies a checkpoint first ------------------------------------------

def test_eval_refuses_a_checkpoint_that_fails_its_manifest(tmp_path, tiny_model_dir,
                                                           monkeypatch):
    from eddyrl import launch
    from eddyrl.config import load_config

    async def fill(tmp):
        shutil.copytree(tiny_model_dir, tmp)
    path = asyncio.run(checkpoints.write(tmp_path / "ckpt", 1, fill))
    weights = next(path.glob("*.safetensors"))
    with open(weights, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    config = load_config(overrides=["platform=cpu"])
    with pytest.raises(checkpoints.CheckpointError, match=f"{weights.name} does not match its "
                                                          "sha256"):
        launch.evaluate_checkpoint(config, str(path), tmp_path / "data")

    class Reached(Exception):
        pass

    def prepare(*args):
        raise Reached

    monkeypatch.setattr(launch, "prepare", prepare)
    with pytest.raises(Reached):  # verify=False: the user said so; it goes on to evaluate
        launch.evaluate_checkpoint(config, str(path), tmp_path / "data", verify=False)

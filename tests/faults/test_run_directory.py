"""Fault injection on the run directory (issue 19's defects 1-4 and 6, and its unclear answers
about run directories): nothing a corrupt checkpoint, a rollback, a refused resume, a second
run or a failed start-up does may lose a good checkpoint, change a run it refused, or leave
the directory unusable. Each scenario is the probe's, replayed on files made here."""

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from eddyrl import checkpoints, resume
from eddyrl.core import run_state
from eddyrl.errors import ConfigError
from eddyrl.run_dir import LOCK, RunDirectory

CHECKPOINTS = resume.CHECKPOINTS


def state(step, seed=0, fingerprint="f", ledger=None):
    meta = {"format": run_state.FORMAT, "step": step, "seed": seed,
            "data": {"fingerprint": fingerprint}, "window": {}, "replay": {},
            "next_group_id": 0, "reward_errors": 0,
            "history": [{"step": s} for s in range(step + 1)], "rng": {}}
    return run_state.RunState(meta, ledger or {"step": step, "groups": {}},
                              {"rng.torch": torch.zeros(4, dtype=torch.uint8)})


def write(run_dir, step, *, ledger_text=None, **kwargs):
    """A run checkpoint of `step` as a run writes one: weights and run state, then the
    manifest. `ledger_text` replaces ledger.json *before* the manifest (so it verifies)."""
    async def fill(tmp):
        tmp.mkdir()
        save_file({"w": torch.full((64,), float(step))}, str(tmp / "model.safetensors"))
        run_state.write(tmp, state(step, **kwargs))
        if ledger_text is not None:
            (tmp / run_state.LEDGER_FILE).write_text(ledger_text)
    return asyncio.run(checkpoints.write(run_dir / CHECKPOINTS, step, fill))


def corrupt(path):
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))


def steps_in(root):
    return sorted(p.name for p in root.glob("step_*"))


def metrics(run_dir, steps):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n"
                                                   for s in steps))


# -- defect 1: pruning never deletes the last good checkpoint --------------------------------

def test_corrupt_newer_checkpoints_never_push_the_good_ones_out(tmp_path):
    """keep_last=1 with a corrupt newest: the good step 4 stays (before: deleted, leaving only
    the corrupt one); with keep_last=2 and two corrupt newer ones, both good ones stay."""
    for step in (3, 4, 5, 6):
        write(tmp_path, step)
    corrupt(tmp_path / CHECKPOINTS / "step_000005")
    corrupt(tmp_path / CHECKPOINTS / "step_000006")
    root = tmp_path / CHECKPOINTS
    checkpoints.prune(root, keep_last=2)
    assert steps_in(root) == ["step_000003", "step_000004", "step_000005", "step_000006"]
    checkpoints.prune(root, keep_last=1)
    assert steps_in(root) == ["step_000004", "step_000005", "step_000006"]
    assert checkpoints.latest(root)[0] == root / "step_000004"


def test_the_probes_keep_last_1_scenario_leaves_a_resumable_run(tmp_path):
    """The probe: keep_last=1, the newest checkpoint (6) corrupt, resume=auto falls back to
    4, writes 5 and prunes. Before, the prune deleted 4 and 5 and kept the corrupt 6: the next
    resume found nothing. Now the abandoned branch (6) is retired aside, 5 is kept, and the
    next resume goes on from 5."""
    root = tmp_path / CHECKPOINTS
    write(tmp_path, 4)
    write(tmp_path, 6)
    corrupt(root / "step_000006")
    metrics(tmp_path, range(7))
    point = resume.find("auto", tmp_path)
    assert point.path == root / "step_000004" and "does not match its sha256" in point.skipped[0]
    retired = resume.begin(point, tmp_path)
    assert steps_in(root) == ["step_000004"]
    assert steps_in(retired) == ["step_000006"]  # named, not deleted
    assert [json.loads(line)["step"] for line in (retired / "metrics.jsonl").open()] == [5, 6]
    write(tmp_path, 5)
    checkpoints.prune(root, keep_last=1)
    assert steps_in(root) == ["step_000005"]
    assert resume.find("auto", tmp_path).path == root / "step_000005"


# -- defect 3: a rollback retires the branch it abandons --------------------------------------

def test_a_rollback_moves_the_newer_checkpoints_and_final_model_aside(tmp_path, caplog):
    root = tmp_path / CHECKPOINTS
    for step in (1, 2, 3):
        write(tmp_path, step)
    checkpoints.mirror(root / "step_000003", tmp_path / resume.FINAL)
    metrics(tmp_path, range(4))
    point = resume.find(str(root / "step_000002"), tmp_path)
    with caplog.at_level(logging.WARNING):
        retired = resume.begin(point, tmp_path)
    assert steps_in(root) == ["step_000001", "step_000002"]
    assert steps_in(retired) == ["step_000003"] and (retired / resume.FINAL).is_dir()
    assert not (tmp_path / resume.FINAL).exists()
    assert "step_000003" in caplog.text and str(retired) in caplog.text
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    # a later resume=auto goes on from the rollback's branch, never the abandoned one
    assert resume.find("auto", tmp_path).path == root / "step_000002"


# -- unclear answers: run state that does not read, a ledger for other data --------------------

def test_a_malformed_ledger_under_a_valid_manifest_falls_back(tmp_path):
    root = tmp_path / CHECKPOINTS
    write(tmp_path, 1)
    write(tmp_path, 2, ledger_text="{not json")
    checkpoints.verify(root / "step_000002")  # the manifest vouches for the broken file
    point = resume.find("auto", tmp_path)
    assert point.path == root / "step_000001"
    assert "step_000002" in point.skipped[0] and "ledger.json is not valid JSON" in \
        point.skipped[0]
    write(tmp_path, 3, ledger_text='{"step": 3, "groups": {"g": {"prompt_index": 0}}}')
    assert resume.find("auto", tmp_path).path == root / "step_000001"  # no history: invalid
    # named by the user: refused by name, one line
    with pytest.raises(checkpoints.CheckpointError, match="step_000002.*ledger.json"):
        resume.find(str(root / "step_000002"), tmp_path)


def test_all_checkpoints_unusable_is_one_error_not_a_fresh_start(tmp_path, caplog):
    """Before: 'starting a fresh run' was printed, then the run was refused for holding one."""
    write(tmp_path, 1)
    corrupt(tmp_path / CHECKPOINTS / "step_000001")
    metrics(tmp_path, range(2))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ConfigError, match="holds a run .* none of its checkpoints .* can be "
                                              "used.*step_000001.*sha256"):
            resume.find("auto", tmp_path)
    assert "fresh run" not in caplog.text


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused_up_front(tmp_path):
    write(tmp_path, 6)
    point = resume.find("auto", tmp_path)
    with pytest.raises(ConfigError, match="'loop.steps' = 3 is below the step of the "
                                          "checkpoint resumed from \\(6"):
        resume.check_settings(point, seed=0, steps=3)
    resume.check_settings(point, seed=0, steps=6)  # the same step: the run's end is redone
    with pytest.raises(ConfigError, match="config key 'seed' = 1"):
        resume.check_settings(point, seed=1, steps=8)


# -- the run directory: usable, locked ----------------------------------------------------------

def test_a_run_dir_that_is_a_file_inside_a_file_or_too_long_is_one_line(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ConfigError, match="run_dir '.*file' is a file, not a directory"):
        RunDirectory.claim(file)
    with pytest.raises(ConfigError, match="lies inside '.*file', which is a file"):
        RunDirectory.claim(file / "run")
    with pytest.raises(ConfigError, match="cannot be used: File name too long; use a shorter"):
        RunDirectory.claim(tmp_path / ("r" * 300))


def test_one_process_cannot_claim_a_run_dir_twice(tmp_path):
    with RunDirectory.claim(tmp_path):
        with pytest.raises(ConfigError, match="in use by another run of this process"):
            RunDirectory.claim(tmp_path)
    RunDirectory.claim(tmp_path).release()  # released: free again


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

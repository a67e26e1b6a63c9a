"""Issue 32's run-directory defects (a 128-case fault probe): Eddy touches only what it wrote.
A non-Eddy directory is refused, an older run's checkpoints count as a run, links in the run
directory are refused and never written through, a checkpoint's name must match its manifest,
and a resume from a retired checkpoint keeps that checkpoint's own history: all on files
alone. Each test's docstring says what happened before. (The lock, with other processes
holding it: test_run_directory_lock.py.)"""

import asyncio
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from eddyrl import checkpoints, resume
from eddyrl.core import run_state
from eddyrl.errors import ConfigError
from eddyrl.run_dir import LOCK, RunDirectory, open_no_follow, write_atomic

CHECKPOINTS = resume.CHECKPOINTS


def write(run_dir, step, history=None, root=None):
    """A run checkpoint of `step` (weights and run state, then the manifest) whose history is
    `history` (default: one bare line per step)."""
    history = history or [{"step": s} for s in range(step + 1)]
    meta = {"format": run_state.FORMAT, "step": step, "seed": 0,
            "data": {"fingerprint": "f"}, "window": {}, "replay": {}, "next_group_id": 0,
            "reward_errors": 0, "history": history, "rng": {}}

    async def fill(tmp):
        tmp.mkdir()
        save_file({"w": torch.full((8,), float(step))}, str(tmp / "model.safetensors"))
        run_state.write(tmp, run_state.RunState(meta, {"step": step, "groups": {}},
                                                {"rng.torch": torch.zeros(4,
                                                                          dtype=torch.uint8)}))
    return asyncio.run(checkpoints.write(root or run_dir / CHECKPOINTS, step, fill))


def tree(path):
    """Every file under `path` with its contents, links as links (not followed)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = os.path.join(root, name)
            key = os.path.relpath(entry, path)
            if os.path.islink(entry):
                out[key] = ("link", os.readlink(entry))
            elif os.path.isfile(entry):
                with open(entry, "rb") as f:
                    out[key] = f.read()
    return out


def train_config(run_dir, *overrides):
    from eddyrl.config import load_config

    return load_config(overrides=[f"run_dir={run_dir}", "platform=cpu", *overrides])


# -- defect 1: a directory that is not Eddy's is refused, naming what is there ---------------

def test_training_into_a_project_folder_is_refused_and_deletes_nothing(tmp_path):
    """Before: `eddy train run_dir=proj` with proj/data, proj/checkpoint and
    proj/checkpoints/step_000001 each holding a user's file exited 0 and all three files were
    gone (data/ and checkpoint/ replaced, step_000001 written over)."""
    from eddyrl.launch import train

    project = tmp_path / "proj"
    for folder in ("data", "checkpoint", "checkpoints/step_000001"):
        (project / folder).mkdir(parents=True)
        (project / folder / "mine.txt").write_text("the user's own")
    (project / "trace.json").write_text("the user's trace")
    before = tree(project)
    with pytest.raises(ConfigError, match="is not empty and is not an Eddy run directory .*"
                                          "it holds 'checkpoint/', 'checkpoints/', 'data/', "
                                          "'trace.json'"):
        train(train_config(project, "loop.steps=1"))
    assert tree(project) == before  # no lock file left either


def test_an_eddy_run_directory_and_an_empty_one_are_claimed(tmp_path):
    (tmp_path / "empty").mkdir()
    RunDirectory.claim(tmp_path / "empty").release()
    hold = RunDirectory.claim(tmp_path / "new")  # made
    (tmp_path / "new" / "config.yaml").write_text("seed: 0\n")  # a run wrote into it
    hold.release()
    # the lock file an earlier claim left marks the directory as Eddy's, whatever else is in
    (tmp_path / "new" / "notes.txt").write_text("a user's note beside a run")
    RunDirectory.claim(tmp_path / "new").release()
    assert (tmp_path / "new" / "notes.txt").read_text() == "a user's note beside a run"
    # a run older than the lock file: metrics.jsonl with a step
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "metrics.jsonl").write_text('{"step": 0}\n')
    RunDirectory.claim(legacy).release()


# -- defect 2: an older run's checkpoints hold a run, with or without metrics.jsonl -------------

def test_a_copied_run_without_its_metrics_is_not_trained_over(tmp_path):
    """Before: with metrics.jsonl moved away, `eddy train run_dir=copy checkpoint.every=1`
    pruned each new checkpoint right after writing it (the old ones counted towards
    keep_last), then crashed with FileNotFoundError, leaving checkpoint/ and summary.json the
    old run's."""
    from eddyrl.launch import train

    run = tmp_path / "copy"
    run.mkdir()
    (run / LOCK).write_text("")
    for step in (4, 6):
        write(run, step)
    before = tree(run)
    with pytest.raises(ConfigError, match="already holds a run .*resume=auto"):
        train(train_config(run, "loop.steps=2", "checkpoint.every=1"))
    assert tree(run) == before


def test_resume_auto_of_a_copied_run_without_metrics_rebuilds_them(tmp_path):
    run = tmp_path / "copy"
    run.mkdir()
    write(run, 6)
    point = resume.find("auto", run)
    assert point.step == 6
    resume.begin(point, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(7))


# -- defect 3: links in the run directory are refused and never written through ----------------

@pytest.mark.parametrize("name", [LOCK, "trace.json", ".config.yaml.tmp", ".summary.json.tmp",
                                  "metrics.jsonl"])
def test_a_link_to_a_file_outside_is_refused_and_the_file_is_untouched(tmp_path, name):
    """Before: `.eddy.lock` as a link to a file outside truncated that file to 0 bytes (even
    when the run was then refused); trace.json and the .tmp files of config.yaml and
    summary.json overwrote their targets."""
    outside = tmp_path / "precious.txt"
    outside.write_text("not Eddy's")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text("") if name != LOCK else None
    (run / name).symlink_to(outside)
    with pytest.raises(ConfigError, match=f"holds symbolic links: '{name}' -> '{outside}'"):
        RunDirectory.claim(run)
    assert outside.read_text() == "not Eddy's"


def test_a_staging_link_to_a_directory_is_refused_and_its_data_kept(tmp_path):
    """Before: `.staging` as a link to a directory had its `data` removed."""
    outside = tmp_path / "elsewhere"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "train.jsonl").write_text("kept")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text("")
    (run / ".staging").symlink_to(outside)
    with pytest.raises(ConfigError, match="holds symbolic links: '.staging'"):
        RunDirectory.claim(run)
    assert (outside / "data" / "train.jsonl").read_text() == "kept"


def test_a_link_deep_in_the_checkpoints_is_refused(tmp_path):
    run = tmp_path / "run"
    write(run, 1)
    (run / LOCK).write_text("")
    (run / CHECKPOINTS / "step_000001" / "extra").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="'checkpoints/step_000001/extra'"):
        RunDirectory.claim(run)


def test_writes_made_after_the_check_do_not_follow_a_link(tmp_path):
    """A link made during a run (after the claim's check): the atomic writes and the metrics
    file refuse it by name and leave its target alone."""
    outside = tmp_path / "precious.txt"
    outside.write_text("not Eddy's")
    (tmp_path / ".summary.json.tmp").symlink_to(outside)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        write_atomic(tmp_path / "summary.json", "{}")
    (tmp_path / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(ConfigError, match="metrics.jsonl' is a symbolic link"):
        open_no_follow(tmp_path / "metrics.jsonl", os.O_WRONLY | os.O_APPEND)
    assert outside.read_text() == "not Eddy's"
    write_atomic(tmp_path / "config.yaml", "seed: 0\n")  # a plain write still works
    assert (tmp_path / "config.yaml").read_text() == "seed: 0\n"


# -- defect 7: a checkpoint's name must agree with its manifest -------------------------------

def test_swapped_checkpoint_names_are_refused_and_passed_over(tmp_path):
    """Before: with step_000004 and step_000006 swapped, `resume=auto` went on "from
    step_000006 (step 4)", retired that same checkpoint and crashed; a second resume exited 0
    with metrics 0-4, 7, 8 (5 and 6 missing)."""
    for step in (3, 4, 6):
        write(tmp_path, step)
    root = tmp_path / CHECKPOINTS
    os.rename(root / "step_000004", root / "swap")
    os.rename(root / "step_000006", root / "step_000004")
    os.rename(root / "swap", root / "step_000006")
    with pytest.raises(checkpoints.CheckpointError, match="named for step 6 but its "
                                                          "manifest.json is of step 4"):
        checkpoints.verify(root / "step_000006")
    point = resume.find("auto", tmp_path)
    assert point.path == root / "step_000003" and point.step == 3
    assert len(point.skipped) == 2
    checkpoints.prune(root, keep_last=1)  # never counted, never deleted
    assert (root / "step_000004").is_dir() and (root / "step_000006").is_dir()


# -- defect 8: a resume from a retired checkpoint keeps that checkpoint's history -------------

def test_resuming_from_a_retired_checkpoint_keeps_its_own_history(tmp_path):
    """Before: `resume=<run>/checkpoints/retired/.../step_000006` kept the other branch's
    metrics lines for steps 5-6, which disagreed with the checkpoint's own history."""
    run = tmp_path / "run"
    main = [{"step": s, "branch": "main" if s > 4 else "shared"} for s in range(9)]
    other = [{"step": s, "branch": "other" if s > 4 else "shared"} for s in range(7)]
    for step in (4, 5, 6, 8):
        write(run, step, main[:step + 1])
    (run / "metrics.jsonl").write_text("".join(json.dumps({**m, "wall_s": 1.0}) + "\n"
                                               for m in main))
    retired = run / CHECKPOINTS / "retired" / "earlier"
    write(run, 6, other, root=retired)
    point = resume.find(str(retired / "step_000006"), run)
    moved_to = resume.begin(point, run)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(7))
    assert [m["branch"] for m in lines] == [m["branch"] for m in other]
    assert [m.get("wall_s") for m in lines[:5]] == [1.0] * 5  # the shared lines stay as they were
    # the main branch's step 5, 6 and 8 went aside with their lines; its step 4 is shared
    assert sorted(p.name for p in (run / CHECKPOINTS).glob("step_*")) == ["step_000004"]
    assert sorted(p.name for p in moved_to.glob("step_*")) == ["step_000005", "step_000006",
                                                              "step_000008"]
    dropped = [json.loads(line)["step"] for line in
               (moved_to / "metrics.jsonl").read_text().splitlines()]
    assert dropped == [5, 6, 7, 8]


# -- unclear answer: a rerun and resume=auto must not send the user to each other ------------

def test_a_run_without_usable_checkpoints_is_not_sent_to_resume_auto(tmp_path):
    """Before: after a run that logged steps but left no usable checkpoint (a full disk), a
    rerun said "go on with resume=auto" and resume=auto said "choose another run_dir": each
    sent the user to the other. Now the rerun's refusal says resume=auto cannot go on, and
    why, and resume=auto's agrees."""
    from eddyrl.launch import train

    (tmp_path / LOCK).write_text("")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (tmp_path / CHECKPOINTS / "step_000001").mkdir(parents=True)  # its write never finished
    with pytest.raises(ConfigError) as rerun:
        train(train_config(tmp_path, "loop.steps=2"))
    assert "none of its checkpoints can be resumed from" in str(rerun.value)
    assert "step_000001' has no manifest.json" in str(rerun.value)
    assert "go on with resume=auto" not in str(rerun.value)
    with pytest.raises(ConfigError, match="none of its checkpoints under .* can be used"):
        train(train_config(tmp_path, "loop.steps=2", "resume=auto"))


def test_links_inside_wandbs_own_folder_are_wandbs(tmp_path):
    """W&B keeps links in <run_dir>/wandb (latest-run); Eddy never writes there, so a resume of
    a run logged to W&B is not refused for them. The folder itself as a link still is."""
    run = tmp_path / "run"
    (run / "wandb" / "run-1").mkdir(parents=True)
    (run / LOCK).write_text("")
    (run / "wandb" / "latest-run").symlink_to(run / "wandb" / "run-1")
    RunDirectory.claim(run).release()
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK).write_text("")
    (other / "wandb").symlink_to(run / "wandb")
    with pytest.raises(ConfigError, match="holds symbolic links: 'wandb'"):
        RunDirectory.claim(other)


def test_a_refused_start_leaves_no_empty_run_directory(tmp_path):
    """Issue 34, item 7: failed start-ups left empty `runs/<date>` folders. A directory the
    claim made and nothing wrote into goes with the release; one that existed stays."""
    RunDirectory.claim(tmp_path / "new").release()
    assert not (tmp_path / "new").exists()
    hold = RunDirectory.claim(tmp_path / "used")
    (tmp_path / "used" / "config.yaml").write_text("seed: 0\n")
    hold.release()
    assert (tmp_path / "used" / "config.yaml").is_file()
    (tmp_path / "there").mkdir()
    RunDirectory.claim(tmp_path / "there").release()
    assert (tmp_path / "there").is_dir()

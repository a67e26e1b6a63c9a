"""Fault injection on the run directory (issue 19's defects 1 and 3, and its unclear answers
about run directories), the rules on files alone: pruning never deletes the last good
checkpoint, a rollback retires the branch it abandons, run state that does not read or a
ledger for other data is passed over or refused by name, and a run directory that cannot be
used or is claimed twice in one process is one line. Each scenario is the probe's, replayed on
files made here (run_dir_cases.py). (Other processes holding the directory, `eddy train` and
`eddy eval` refusing before they write: test_run_directory.py.)"""

import json
import logging

import pytest

from eddyrl import checkpoints, resume
from eddyrl.errors import ConfigError
from eddyrl.run_dir import RunDirectory

from run_dir_cases import CHECKPOINTS, corrupt, metrics, steps_in, write


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

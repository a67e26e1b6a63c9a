"""Run checkpoints on disk (`eddyrl/checkpoints.py`): written whole or not at all, checked
against their manifest, a partial or corrupt one named and passed over, the newest N kept."""

import asyncio
import json
import logging
import os

import pytest

from eddyrl import checkpoints
from eddyrl.checkpoints import CheckpointError
from eddyrl.config import load_config
from eddyrl.errors import ConfigError


def _write(root, step, files=None):
    async def fill(tmp):
        (tmp / "sub").mkdir(parents=True)
        for name, data in (files or {"model.safetensors": b"w" * 100,
                                     "sub/state.json": b"{}"}).items():
            (tmp / name).write_bytes(data)
    return asyncio.run(checkpoints.write(root, step, fill))


def test_a_written_checkpoint_verifies_and_lists_every_file(tmp_path):
    path = _write(tmp_path, 3)
    assert path == tmp_path / "step_000003" and checkpoints.step_of(path) == 3
    manifest = checkpoints.verify(path)
    assert manifest["step"] == 3
    assert sorted(manifest["files"]) == ["model.safetensors", "sub/state.json"]
    assert manifest["files"]["model.safetensors"]["bytes"] == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"]  # nothing else left


@pytest.mark.parametrize("damage,message", [
    (lambda p: (p / "manifest.json").unlink(), "has no manifest.json: its write did not finish"),
    (lambda p: (p / "manifest.json").write_text("{"), "manifest.json is not a valid manifest"),
    (lambda p: (p / "sub" / "state.json").unlink(), "is missing sub/state.json"),
    (lambda p: (p / "model.safetensors").write_bytes(b"w" * 60),
     "model.safetensors is 60 bytes, the manifest says 100 (truncated"),
    (lambda p: (p / "model.safetensors").write_bytes(b"x" * 100),
     "model.safetensors does not match its sha256 in manifest.json (corrupt)"),
])
def test_a_damaged_checkpoint_is_named_with_what_is_wrong(tmp_path, damage, message):
    path = _write(tmp_path, 1)
    damage(path)
    with pytest.raises(CheckpointError) as error:
        checkpoints.verify(path)
    assert f"checkpoint '{path}'" in str(error.value) and message in str(error.value)


def test_latest_falls_back_past_corrupt_and_partial_checkpoints_naming_each(tmp_path, caplog):
    for step in (1, 2, 3):
        _write(tmp_path, step)
    (tmp_path / "step_000003" / "model.safetensors").write_bytes(b"w" * 99)  # truncated
    (tmp_path / "step_000004").mkdir()  # a crash of a writer that did not use a rename
    (tmp_path / ".step_000005.tmp").mkdir()  # an unfinished write
    with caplog.at_level(logging.WARNING):
        found, skipped = checkpoints.latest(tmp_path)
    assert found == tmp_path / "step_000002"
    assert len(skipped) == 3
    for name in ("step_000003", "step_000004", ".step_000005.tmp"):
        assert sum(name in reason for reason in skipped) == 1, name
        assert name in caplog.text
    assert "truncated" in caplog.text and "falling back" in caplog.text
    assert checkpoints.latest(tmp_path / "nothing") == (None, [])


def test_a_failure_mid_write_leaves_no_partial_checkpoint(tmp_path):
    _write(tmp_path, 1)

    async def fill(tmp):
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        asyncio.run(checkpoints.write(tmp_path, 2, fill))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert checkpoints.latest(tmp_path) == (tmp_path / "step_000001", [])


def test_rewriting_a_step_replaces_it_whole_and_moves_the_old_one_aside(tmp_path):
    """Issue 32: a step directory already there is not the writer's to delete (before: it
    was deleted); it goes under retired/, the new one is written whole."""
    _write(tmp_path, 2, {"a": b"old", "sub/b": b"old"})
    _write(tmp_path, 2, {"a": b"new"})
    assert sorted(checkpoints.verify(tmp_path / "step_000002")["files"]) == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.RETIRED, "step_000002"]
    (old,) = (tmp_path / checkpoints.RETIRED).glob("*-replaced/step_000002")
    assert sorted(checkpoints.verify(old)["files"]) == ["a", "sub/b"]


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 10):
        _write(tmp_path, step)
    (tmp_path / "step_000011").mkdir()  # broken: kept for a person to look at, not counted
    (tmp_path / ".step_000012.tmp").mkdir()
    removed = checkpoints.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == [".step_000012.tmp", "step_000001", "step_000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000010",
                                                          "step_000011"]


def test_mirror_is_a_copy_replaced_atomically(tmp_path):
    """Issue 32: `save_pretrained` into `<run_dir>/checkpoint` rewrites its files in place;
    before, they were hard links to the last step checkpoint, which it corrupted."""
    source = _write(tmp_path / "checkpoints", 1)
    target = tmp_path / "checkpoint"
    target.mkdir()
    (target / "stale").write_text("from an earlier run")
    checkpoints.mirror(source, target)
    assert not (target / "stale").exists()
    assert not os.path.samefile(target / "model.safetensors", source / "model.safetensors")
    checkpoints.verify(target)  # the manifest goes with it
    with open(target / "model.safetensors", "r+b") as f:  # written in place, as a save does
        f.write(b"overwritten")
    checkpoints.verify(source)  # the step checkpoint is untouched


def test_config_section_is_validated_by_key():
    config = load_config(overrides=["checkpoint.every=5", "checkpoint.keep_last=3"])
    assert (config.checkpoint.every, config.checkpoint.keep_last) == (5, 3)
    for override, key in (("checkpoint.every=-1", "checkpoint.every"),
                          ("checkpoint.keep_last=0", "checkpoint.keep_last")):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            load_config(overrides=[override])


def test_resume_names_a_bad_path_and_a_refused_checkpoint(tmp_path):
    from eddyrl import resume

    with pytest.raises(ConfigError, match="config key 'resume' = .*no such checkpoint"):
        resume.find(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(ConfigError, match="no complete checkpoint under"):
        resume.find(str(tmp_path), tmp_path)
    path = _write(tmp_path / "checkpoints", 4)
    (path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="step_000004.*truncated"):
        resume.find(str(path), tmp_path)  # named by the user: refused, no fallback
    assert resume.find("auto", tmp_path / "elsewhere") is None  # nothing to resume: fresh
    assert resume.find(None, tmp_path) is None


def test_metrics_after_the_checkpoint_are_dropped(tmp_path):
    from eddyrl import resume
    from eddyrl.core.run_state import RunState

    point = resume.ResumePoint(tmp_path, RunState(
        {"step": 2, "history": [{"step": s} for s in range(3)]}, {}, {}))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)) + '{"step": 5')
    assert resume.restart_metrics(metrics, point) == 3  # steps 3, 4 and the cut-off line
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2]
    fresh = tmp_path / "new" / "metrics.jsonl"
    fresh.parent.mkdir()
    resume.restart_metrics(fresh, point)  # a new run_dir gets the checkpoint's history
    assert fresh.read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'

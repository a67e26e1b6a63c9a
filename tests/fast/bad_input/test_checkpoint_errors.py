"""Bad checkpoints: truncated, corrupt, unfinished or missing ones are named (by path and file)
and never trusted, and `resume=auto` falls back past them. (A trainer's save that fails
half-way: test_trainer_save_failure.py.)"""

import asyncio
import logging

import pytest
import torch
from safetensors.torch import save_file

from eddyrl import checkpoints, resume
from eddyrl.checkpoints import CheckpointError
from eddyrl.errors import ConfigError


def write(root, step):
    """A checkpoint of real safetensors weights, written the way a run writes one."""
    async def fill(tmp):
        tmp.mkdir()
        save_file({"w": torch.arange(256, dtype=torch.float32) * step},
                  str(tmp / "model.safetensors"))
        (tmp / "eddy_train_state.json").write_text(f'{{"version": {step}}}')
    return asyncio.run(checkpoints.write(root, step, fill))


def resume_error(path, run_dir, kind=CheckpointError) -> str:
    with pytest.raises(kind) as error:
        resume.find(str(path), run_dir)
    return str(error.value)


def test_truncated_safetensors_is_detected_and_passed_over(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    write(root, 2)
    newest = write(root, 4)
    weights = newest / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:size // 2])
    message = (f"checkpoint '{newest}': model.safetensors is {size // 2} bytes, the manifest "
               f"says {size} (truncated or partly written)")
    assert resume_error(newest, tmp_path) == message  # named by the user: refused
    with caplog.at_level(logging.WARNING, logger="eddyrl.checkpoints"):
        found, skipped = checkpoints.latest(root)  # what resume=auto takes
    assert found == root / "step_000002"
    assert skipped == [f"{message}; falling back to an earlier checkpoint"]
    assert caplog.records[0].getMessage() == skipped[0]


def test_corrupt_checkpoint_named_by_resume_is_refused(tmp_path):
    path = write(tmp_path / "checkpoints", 3)
    weights = bytearray((path / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF  # same size, one byte changed
    (path / "model.safetensors").write_bytes(bytes(weights))
    assert resume_error(path, tmp_path) == (
        f"checkpoint '{path}': model.safetensors does not match its sha256 in manifest.json "
        "(corrupt)")


def test_checkpoint_whose_write_did_not_finish(tmp_path):
    path = write(tmp_path / "checkpoints", 3)
    (path / "manifest.json").unlink()
    assert resume_error(path, tmp_path) == (
        f"checkpoint '{path}' has no manifest.json: its write did not finish")


def test_checkpoint_with_a_mangled_manifest(tmp_path):
    path = write(tmp_path / "checkpoints", 3)
    (path / "manifest.json").write_text('{"files": ')
    assert resume_error(path, tmp_path) == (
        f"checkpoint '{path}': manifest.json is not a valid manifest")


def test_checkpoint_missing_a_file(tmp_path):
    path = write(tmp_path / "checkpoints", 3)
    (path / "eddy_train_state.json").unlink()
    assert resume_error(path, tmp_path) == f"checkpoint '{path}' is missing eddy_train_state.json"


def test_resume_path_that_does_not_exist(tmp_path):
    assert resume_error(tmp_path / "run7", tmp_path, ConfigError) == (
        f"config key 'resume' = '{tmp_path / 'run7'}': no such checkpoint or directory (use "
        "resume=auto, or a path to a checkpoint or a run directory)")

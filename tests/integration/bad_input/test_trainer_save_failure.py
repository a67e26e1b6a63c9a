"""A save of the FSDP trainer that fails half-way (disk full) leaves the previous good
checkpoint exactly as it was: the tiny model's own trainer, not a hand-written checkpoint
(those, bad in every other way, are in test_checkpoint_errors.py)."""

import asyncio

import pytest

from eddyrl import checkpoints


def test_failed_trainer_save_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    """The FSDP trainer's own save fails half-way (disk full), for a new step and for the same
    step again: the good checkpoint is untouched and still verifies and loads."""
    from eddyrl.engines.registry import load_engine_class
    from eddyrl.hal import get_platform

    engine = load_engine_class("train", "fsdp")(tiny_model_dir, get_platform("cpu"), 0, 1,
                                                f"file://{tmp_path}/init", seed=0)
    try:
        root = tmp_path / "checkpoints"

        async def save(tmp):
            engine.save(str(tmp))

        good = asyncio.run(checkpoints.write(root, 2, save))
        manifest = checkpoints.verify(good)

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(engine.model, "save_pretrained", disk_full)
        for step in (4, 2):
            with pytest.raises(OSError, match="No space left on device"):
                asyncio.run(checkpoints.write(root, step, save))
        assert checkpoints.latest(root) == (good, [])  # nothing partial left behind
        assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
        assert checkpoints.verify(good) == manifest  # every file as it was
        engine.load(str(good))  # and it loads
        assert engine.version == 0
    finally:
        engine.close()

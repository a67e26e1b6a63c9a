"""Nothing in the trainer's checkpoint is loaded with pickle: the FSDP trainer's files (weights,
optimizer state through DCP, RNG) load with pickle switched off. (The controller's run state
and the package's own code: test_no_pickle_checkpoints.py.)"""

import random

import torch
from fsdp_helpers import make_batch, save_tiny_model
from pickle_guard import no_pickle  # noqa: F401 (a fixture)

from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.training.fsdp import FSDPTrainEngine
from eddyrl.hal import get_platform

LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28)


def _optimizer_tensors(engine):
    return {(name, key): (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
            for name, state in engine.optimizer.state_dict()["state"].items()
            for key, value in state.items()}


def test_trainer_checkpoint_loads_with_pickle_off(tmp_path, no_pickle):
    model_dir = save_tiny_model(str(tmp_path / "model"))
    batch = make_batch(model_dir)
    cpu = get_platform("cpu")
    first = FSDPTrainEngine(model_dir, cpu, 0, 1, f"file://{tmp_path}/a", lr=1e-3, seed=0)
    try:
        first.train_step(batch, LOSS)
        optimizer = _optimizer_tensors(first)
        random.seed(11), torch.manual_seed(12)
        first.save(str(tmp_path / "ckpt"))
        rng = (random.random(), torch.rand(3))  # what the generators give after the save
    finally:
        first.close()
    second = FSDPTrainEngine(model_dir, cpu, 0, 1, f"file://{tmp_path}/b", lr=1e-3, seed=5)
    try:
        second.load(str(tmp_path / "ckpt"))
        restored = _optimizer_tensors(second)
        assert restored.keys() == optimizer.keys() and len(restored) > 10
        assert all(torch.equal(restored[k], optimizer[k]) for k in optimizer)
        assert random.random() == rng[0] and torch.equal(torch.rand(3), rng[1])
    finally:
        second.close()

"""Nothing in a checkpoint is loaded with pickle: the trainer's files (weights, optimizer state
through DCP, RNG) and the controller's run state load with pickle switched off, and no module
of the package imports pickle or calls `torch.load` without `weights_only=True`."""

import pickle
import random
import re
from pathlib import Path

import pytest
import torch
from fsdp_helpers import make_batch, save_tiny_model

from eddyrl.core import run_state
from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.training.fsdp import FSDPTrainEngine
from eddyrl.hal import get_platform

PACKAGE = Path(__file__).resolve().parents[2] / "eddyrl"
LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28)


def _refuse(*args, **kwargs):
    raise AssertionError("a checkpoint was read with pickle")


@pytest.fixture
def no_pickle(monkeypatch):
    """pickle's entry points raise; `torch.load` only with weights_only=True (its own
    restricted unpickler, which allows tensors and plain containers only)."""
    real_load = torch.load

    def weights_only_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "torch.load without weights_only=True"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(pickle, "load", _refuse)
    monkeypatch.setattr(pickle, "loads", _refuse)
    monkeypatch.setattr(pickle, "Unpickler", _refuse)
    monkeypatch.setattr(torch, "load", weights_only_load)


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


def test_run_state_loads_with_pickle_off(tmp_path, no_pickle):
    meta = {"format": run_state.FORMAT, "step": 1, "seed": 0, "data": {}, "window": {},
            "replay": {}, "next_group_id": 0, "reward_errors": 0, "history": [], "rng": {}}
    state = run_state.RunState(meta, {"step": 1, "groups": {}},
                               {"rng.torch": torch.get_rng_state()})
    run_state.write(tmp_path, state)
    back = run_state.read(tmp_path)
    assert torch.equal(back.tensors["rng.torch"], state.tensors["rng.torch"])


# The user-code pool hands calls and results to the worker processes it started itself over a
# socketpair, by pickle (SECURITY.md: a process worker isolates crashes and hangs of the run's
# own reward and environment code, not hostile code). Nothing there reads a file or a socket
# anyone else can write.
PICKLES_TO_ITS_OWN_CHILDREN = {"usercode"}


def test_the_package_never_unpickles():
    for path in PACKAGE.rglob("*.py"):
        code = path.read_text()
        if path.relative_to(PACKAGE).parts[0] in PICKLES_TO_ITS_OWN_CHILDREN:
            assert not re.search(r"\bopen\(|\.load\(", code), path  # no file, ever
            continue
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|joblib)\b", code, re.M), path
        for call in re.finditer(r"torch\.load\(", code):
            window = code[call.end():call.end() + 300]
            assert "weights_only=True" in window.split(")\n")[0], f"{path}: {window[:80]}"

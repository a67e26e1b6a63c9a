"""Shared by the no-pickle checkpoint tests: the `no_pickle` fixture, under which pickle's
entry points raise and `torch.load` runs only with weights_only=True."""

import pickle

import pytest
import torch


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

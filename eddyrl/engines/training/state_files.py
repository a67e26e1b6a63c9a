"""A training engine's state besides its weights, on disk without pickle.

- Optimizer: the tensors (Adam's moments and step counters, sharded like the parameters) go
  through torch.distributed.checkpoint into safetensors files, one per rank, with the sharding
  in each file's header; DCP can load them into another sharding (a resume on a different
  number of ranks). DCP's default format keeps its index and every non-tensor value as pickle,
  which would unpickle whatever a checkpoint directory holds; here the index is the safetensors
  headers and the few non-tensor values (the param groups' lr, betas, ...) are JSON. On load
  those settings come from the config, not the checkpoint (a resume may lower the learning
  rate, say); a difference is logged.
- RNG: each rank's generators (host and device, through the platform) and Python's `random`,
  one safetensors file per rank.

Reading uses safetensors and JSON only: no pickle, no `torch.load`.
"""

from __future__ import annotations

import json
import logging
import os
import random

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from ...errors import EddyError
from ...hal import Platform

log = logging.getLogger(__name__)

PARAM_GROUPS_FILE = "param_groups.json"
ENGINE_STATE_FILE = "eddy_train_state.json"  # the engine's version and what it saved
RNG_DIR = "rng"


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str,
                   rank: int) -> None:
    """Collective: every rank writes its shards under `path`; rank 0 the param groups."""
    state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"state": state["state"]},
             storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))
    if rank == 0:
        with open(os.path.join(path, PARAM_GROUPS_FILE), "w") as f:
            json.dump(state["param_groups"], f)


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Collective: the sharded state saved by `save_optimizer`, into this model's sharding."""
    if not os.path.isfile(os.path.join(path, PARAM_GROUPS_FILE)):
        raise EddyError(f"'{path}' holds no optimizer state Eddy can read without pickle "
                        f"(no {PARAM_GROUPS_FILE}); it was written by an older version")
    template = get_optimizer_state_dict(model, optimizer)  # the shapes and shardings to fill
    dcp.load({"state": template["state"]}, storage_reader=HuggingFaceStorageReader(path))
    with open(os.path.join(path, PARAM_GROUPS_FILE)) as f:
        saved_groups = json.load(f)
    current = json.loads(json.dumps(template["param_groups"]))  # tuples as lists, like saved
    changed = sorted({key for saved, now in zip(saved_groups, current) for key in saved
                      if key != "params" and saved[key] != now.get(key)})
    if changed:
        log.warning(f"optimizer settings {changed} differ from those in '{path}'; the "
                    "configured values are used")
    set_optimizer_state_dict(model, optimizer, template)


def save_rng(platform: Platform, directory: str, rank: int) -> None:
    os.makedirs(os.path.join(directory, RNG_DIR), exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in platform.get_rng_state().items()}
    version, internal, gauss = random.getstate()
    save_file(state, _rng_file(directory, rank),
              metadata={"python_random": json.dumps([version, list(internal), gauss])})


def load_rng(platform: Platform, directory: str, rank: int) -> bool:
    """Restore this rank's generators; False when the checkpoint has none for this rank (it
    was written by fewer ranks), which leaves them as seeded."""
    path = _rng_file(directory, rank)
    if not os.path.isfile(path):
        return False
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    platform.set_rng_state(load_file(path))
    if "python_random" in metadata:
        version, internal, gauss = json.loads(metadata["python_random"])
        random.setstate((version, tuple(internal), gauss))
    return True


def _rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, RNG_DIR, f"rank_{rank:05d}.safetensors")

"""The FSDP engine's checkpoint: the weights in Hugging Face's format (with LoRA, peft's
adapter files), the optimizer state and generators without pickle (state_files.py), the
engine's version; written into a staging directory that appears whole, and loaded back on any
number of ranks. `engine`: an `FSDPTrainEngine` (fsdp.py), whose `save` and `load` call these.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)

from ... import fault_points
from ...errors import ConfigError
from ..config import LoraConfig
from ...hal import distributed as hd
from . import lora as lora_layers
from .fsdp_weights import full_tensors
from .state_files import ENGINE_STATE_FILE, load_optimizer, load_rng, save_optimizer, save_rng

OPTIM_DIR = "optim"  # torch.distributed.checkpoint shards of the optimizer state (safetensors)
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                   "merges.txt", "chat_template*")


def save(engine: Any, path: str, *, node_local: bool = False) -> None:
    """Collective (`TrainEngine.save`): every rank writes its optimizer shard and generators,
    rank 0 the weights, the tokenizer's files and the engine's state, then renames the staging
    directory into place (not `node_local`: there each rank's directory stays where it is)."""
    final = os.path.abspath(path)
    staging = final if node_local else final + ".tmp"
    if engine.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    hd.barrier()
    os.makedirs(staging, exist_ok=True)  # on a node of its own, a rank makes its own
    if engine.lora is None:
        full = get_model_state_dict(engine.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))  # collective; rank 0 gets the tensors
    else:  # the adapter alone (the base is the model it names): collective too
        full = {name: t.cpu() for name, t in full_tensors(engine.model, lora_layers.is_adapter)}
    # Before the first step the optimizer has no state; asking for its state dict would
    # create it with step = 1 and change the next update, so record its absence instead.
    has_optim = bool(engine.optimizer.state)
    fault_points.reached("checkpoint_write", engine.rank, engine.version)
    if has_optim:
        save_optimizer(engine.model, engine.optimizer, os.path.join(staging, OPTIM_DIR),
                       engine.rank)
    save_rng(engine.platform, staging, engine.rank)  # dropout, sampling: an exact resume
    # every rank's files are in staging before rank 0 renames it: a rank still writing
    # its RNG file after the rename would leave it out of the checkpoint, in a stray
    # directory (found under load: a rank's makedirs raced the rename)
    hd.barrier()
    if engine.rank == 0:
        if engine.lora is None:
            engine.model.save_pretrained(staging, state_dict=full)
        else:  # peft's format: adapter_config.json + adapter_model.safetensors
            lora_layers.save_adapter(staging, full, engine.lora, engine.model_path)
        for pattern in TOKENIZER_FILES:
            for source in glob.glob(os.path.join(engine.model_path, pattern)):
                shutil.copy2(source, staging)
        with open(os.path.join(staging, ENGINE_STATE_FILE), "w") as f:
            json.dump({"version": engine.version, "optimizer_state": has_optim,
                       "lora_rank": engine.lora.rank if engine.lora else 0}, f)
        if not node_local:
            _replace_dir(staging, final)
    hd.barrier()


def load(engine: Any, path: str) -> None:
    """Collective: rank 0 reads the weights and every rank receives its shards by broadcast;
    each rank loads its optimizer state (resharded where the world differs) and generators."""
    path = os.path.abspath(path)
    with open(os.path.join(path, ENGINE_STATE_FILE)) as f:
        state = json.load(f)
    check_lora_matches(engine.lora, path, state.get("lora_rank", 0))
    full: dict[str, torch.Tensor] = {}
    if engine.rank == 0 and engine.lora is not None:  # the adapter; the base is unchanged
        full = lora_layers.read_adapter(path)
    elif engine.rank == 0:  # the others receive it by broadcast
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            full.update(load_file(file))
        for alias, owner in engine.aliases.items():  # HF drops tied copies on save
            full.setdefault(alias, full[owner])
    set_model_state_dict(engine.model, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=engine.lora is None))
    engine.optimizer.state.clear()
    if state["optimizer_state"]:
        load_optimizer(engine.model, engine.optimizer, os.path.join(path, OPTIM_DIR))
    load_rng(engine.platform, path, engine.rank)
    engine.version = int(state["version"])
    hd.barrier()


def check_lora_matches(lora: LoraConfig | None, path: str, saved_rank: int) -> None:
    """The checkpoint's adapter (`saved_rank`; 0: full weights) is the kind this run trains."""
    rank = lora.rank if lora else 0
    if saved_rank != rank:
        holds = f"a LoRA adapter of rank {saved_rank}" if saved_rank else "full weights"
        raise ConfigError(f"checkpoint {path} holds {holds}; this run has "
                          f"train.lora.rank = {rank}: resume with the setting the "
                          "checkpoint was trained with")


def _replace_dir(staging: str, final: str) -> None:
    """Put `staging` at `final`. A rename is atomic; replacing an existing directory needs two,
    so a crash in between leaves the previous checkpoint at `final`.old, never half a one."""
    previous = final + ".old"
    shutil.rmtree(previous, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, previous)
    os.rename(staging, final)
    shutil.rmtree(previous, ignore_errors=True)

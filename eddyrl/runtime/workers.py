"""What a run's two kinds of worker process share: the model's directory on this node, the
process's preparation, the record of its device, and the weight broadcast group's layout. The
processes themselves: a rollout worker (rollout_worker.py) wraps an inference engine, a trainer
rank (trainer_rank.py) a training engine; both are plain classes, which `runtime/ray/
runtime.py` turns into Ray actors and `runtime/local.py` runs in one process."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .node_files import DirectoryShipment

if TYPE_CHECKING:
    from .config import ClusterConfig


def local_model_dir(model: str | DirectoryShipment) -> str:
    """The model's directory on this node: the path itself on one machine or a shared
    filesystem, else this node's copy of the driver's (written once per node)."""
    return model.materialize() if isinstance(model, DirectoryShipment) else model


def prepare_process(cluster: ClusterConfig) -> None:
    """Every worker process: quiet model loads, its share of the CPU threads."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load bars from every worker drown the run's output
    torch.set_num_threads(cluster.threads_per_worker or os.cpu_count() or 1)


def device_binding(device) -> dict[str, object]:
    """An actor's device and the process that holds it (placement.json: which process to
    look at, or a fault test's to kill)."""
    return {**device.as_dict(), "pid": os.getpid()}


def weight_group_layout(ranks: list[int]) -> tuple[list[int], int]:
    """The weight broadcast group: the trainer is rank 0 (it sends); rollout worker i takes
    `ranks[i]` ranks (`RolloutWorker.weight_ranks`) from its offset on. Returns (offsets,
    world size)."""
    if any(r < 1 for r in ranks):
        raise ValueError(f"every rollout worker takes at least one rank, got {ranks}")
    offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
    return offsets, 1 + sum(ranks)

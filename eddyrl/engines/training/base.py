"""The training-engine contract. One engine instance per data-parallel rank; every method that
touches the model is collective across the ranks of one trainer (all ranks call it)."""

from __future__ import annotations

import abc
from typing import Iterator, Protocol

import torch

from ...protocol import TrainBatch


class LossFn(Protocol):
    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch, total_tokens: int,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """`logprobs` [B, L] from the current policy for this micro-batch; `total_tokens` is the
        number of loss tokens in the whole step across all ranks, so the sum of per-micro-batch
        losses is a token-level mean over the global batch whatever the split."""


class TrainEngine(abc.ABC):
    version: int  # policy version of the current weights; +1 per optimizer step

    @abc.abstractmethod
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] log-probs of `batch.input_ids` under the current weights (no grad)."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *,
                   logprobs_out: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step over this rank's share of the batch; `logprobs_out` ([B, L]),
        when given, receives the log-probs of its forward passes (the weights before the
        step: what `compute_logprobs` gives), so a caller needs no second pass."""

    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int, *, low_rank: bool = False
                       ) -> Iterator[dict[str, torch.Tensor]]:
        """Full (unsharded) weights in HF names, streamed in buckets of about `bucket_bytes`.
        Collective; only rank 0 yields tensors. `low_rank`: the receiver merges LoRA factors
        itself (engines/low_rank.py), so an engine training LoRA adapters sends only those."""

    @abc.abstractmethod
    def save(self, path: str, *, node_local: bool = False) -> None:
        """HF safetensors model (plain transformers loads it; with LoRA, peft's adapter files)
        + optimizer state, in `path`, which appears whole. `node_local`: `path` is on this node's own disk, not on one every
        rank sees (a cluster without a shared run directory): each rank writes its own files
        there and nothing is renamed; the runtime collects them from the nodes."""

    @abc.abstractmethod
    def load(self, path: str) -> None:
        ...

    @abc.abstractmethod
    def offload(self) -> None:
        """Move weights and optimizer state to host memory."""

    @abc.abstractmethod
    def onload(self) -> None:
        ...


    # ---- in-place recovery of a lost rank (docs/reliability.md); an engine without copies
    # of its state leaves a lost rank to a resume from the last checkpoint -------------------
    def snapshot(self) -> None:
        """Copy this rank's state to a peer (buddy replication); all ranks together."""

    def replication_metrics(self) -> dict[str, float]:
        """What copying the state to a peer cost the last step (seconds, by name)."""
        return {}

    def recovery_copies(self) -> tuple[object | None, object | None]:
        """This rank's own last copy and the copy it keeps of a peer's (`shard_copy.ShardCopy`),
        None where it has none."""
        return None, None

    def abandon(self) -> None:
        """Leave a process group one of whose ranks was lost, so that a new one can form."""

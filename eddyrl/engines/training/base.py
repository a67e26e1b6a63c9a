"""The training-engine contract. One engine instance per data-parallel rank; every method that
touches the model is collective across the ranks of one trainer (all ranks call it)."""

from __future__ import annotations

import abc
from typing import Iterator, Protocol

import torch

from ...protocol import TrainBatch


def micro_batches(batch: TrainBatch, size: int) -> list[tuple[torch.Tensor, TrainBatch]]:
    """`batch`'s rows in micro-batches of at most `size` rows, rows of like length together,
    each cut after its longest row's last real token; with the indices of its rows in `batch`.
    Rows are right-padded, and under causal attention a real token never sees a later
    position, so the cut drops only work on padding: measured on the default run's batches,
    sorted and cut micro-batches of 32-64 rows hold 0.53-0.75 of the positions of the padded
    ones (the batch's longest row sets the padded width, its median row is half that). Each
    row's log-probs are the same as in the padded batch up to float summation order; on
    padding, `place_rows` writes 0 (the loss mask is 0 there)."""
    if len(batch) == 0:
        return []
    mask = batch.attention_mask.bool()
    # one past each row's last real position (0 for a row without any)
    ends = torch.where(mask.any(1), mask.shape[1] - mask.flip(1).int().argmax(1), 0)
    order = torch.argsort(ends, stable=True)
    out = []
    for start in range(0, len(batch), size):
        rows = order[start:start + size]
        width = max(int(ends[rows].max()), 1)
        out.append((rows, batch.select(rows).select_columns(width)))
    return out


def place_rows(out: torch.Tensor, rows: torch.Tensor, micro: TrainBatch,
               values: torch.Tensor) -> None:
    """Write a micro-batch's [b, w] log-probs into rows `rows`, positions 0..w-1, of `out`,
    0 on padding (what a padded position's log-prob would be is meaningless, and differs with
    the cut)."""
    real = micro.attention_mask.to(values.device).bool()
    out[rows, :values.shape[1]] = torch.where(real, values, 0.0).to(out.device, out.dtype)


class LossFn(Protocol):
    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch, total_tokens: int,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """`logprobs` [B, L] from the current policy for this micro-batch; `total_tokens` is the
        number of loss tokens in the whole step across all ranks, so the sum of per-micro-batch
        losses is a token-level mean over the global batch whatever the split."""


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, L] log p(input_ids[t] | input_ids[:t]) at `temperature`; position 0 gets 0. Shared by
    every engine that trains, so a joined replica's gradients are the core ranks' exactly."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    # Divided by the temperature first, because the sampler reports log-probs of the
    # temperature-scaled distribution. Simplified: the full [B, L, V] fp32 log-softmax; a
    # chunked one would save memory at large vocabularies.
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    token_logp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(token_logp, (1, 0))


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
    def export_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Full (unsharded) weights in HF names, streamed in buckets of about `bucket_bytes`.
        Collective; only rank 0 yields tensors."""

    @abc.abstractmethod
    def save(self, path: str, *, node_local: bool = False) -> None:
        """HF safetensors model (plain transformers loads it) + optimizer state, in `path`,
        which appears whole. `node_local`: `path` is on this node's own disk, not on one every
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


"""From collected groups to the tensors of a training step, and a token-balanced split of
those rows across data-parallel ranks."""

from __future__ import annotations

import torch

from .advantages import broadcast_to_tokens, group_advantages
from .partition import balanced_partition
from ..protocol import Group, TrainBatch, Trajectory


def build_train_batch(groups: list[Group], pad_id: int, *, normalize_std: bool = True,
                      weights: list[float] | None = None,
                      correction_scale: float | None = None) -> TrainBatch:
    """One row per trajectory: prompt + response, right-padded; log-probs and versions aligned
    so that position t describes token t (see `TrainBatch` in protocol.py). The loss mask is the response's
    own (`GenerationResult.loss_mask`: environment tokens of a multi-turn episode are 0, and
    like padding carry log-prob 0 and version -1 here). `weights` gives each group's loss
    weight (1 fresh, tau replayed); default 1. The experts a MoE rollout recorded (routing
    replay) are aligned like `input_ids`: row t holds token t's, -1 where unknown.
    `correction_scale`: the governor's scale of the correction's bounds, on every row (None: the
    configured bounds)."""
    rows = [(g, t) for g in groups for t in g.trajectories]
    weights = [1.0] * len(groups) if weights is None else weights
    if len(weights) != len(groups):
        raise ValueError(f"{len(weights)} weights for {len(groups)} groups")
    if not rows:
        raise ValueError("cannot build a training batch from no trajectories")
    width = max(len(g.prompt_ids) + t.num_tokens for g, t in rows)
    size = (len(rows), width)
    input_ids = torch.full(size, pad_id, dtype=torch.long)
    attention = torch.zeros(size, dtype=torch.long)
    loss_mask = torch.zeros(size)
    old_logprobs = torch.zeros(size)
    versions = torch.full(size, -1, dtype=torch.long)
    experts = _experts_tensor(rows, size)
    for i, (group, traj) in enumerate(rows):
        p, n = len(group.prompt_ids), traj.num_tokens
        input_ids[i, :p + n] = torch.tensor(group.prompt_ids + traj.result.token_ids)
        attention[i, :p + n] = 1
        mask = torch.ones(n) if traj.result.loss_mask is None else \
            torch.tensor(traj.result.loss_mask, dtype=torch.float32)
        if mask.shape != (n,):
            raise ValueError(f"trajectory {traj.result.request_id}: loss mask of "
                             f"{mask.numel()} for {n} tokens")
        loss_mask[i, p:p + n] = mask
        old_logprobs[i, p:p + n] = torch.tensor(traj.result.logprobs) * mask
        versions[i, p:p + n] = torch.where(mask > 0, torch.tensor(traj.result.versions), -1)
        if experts is not None and traj.result.routed_experts is not None:
            routed = traj.result.routed_experts.as_tensor()[:p + n]
            experts[i, :len(routed)] = routed
    advantages = torch.cat([group_advantages(torch.tensor(g.rewards), len(g.rewards),
                                             normalize_std=normalize_std) for g in groups])
    return TrainBatch(input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask,
                      old_logprobs=old_logprobs,
                      advantages=broadcast_to_tokens(advantages, loss_mask),
                      sample_weights=torch.tensor([w for g, w in zip(groups, weights)
                                                   for _ in g.trajectories], dtype=torch.float32),
                      versions=versions,
                      prompt_lengths=torch.tensor([len(g.prompt_ids) for g, _ in rows]),
                      routed_experts=experts,
                      correction_scale=None if correction_scale is None else
                      torch.full((len(rows),), float(correction_scale)))


def _experts_tensor(rows: list[tuple[Group, Trajectory]], size: tuple[int, int]
                    ) -> torch.Tensor | None:
    """[B, L, layers, top_k] of -1, for the experts the rows recorded (rollout routing replay),
    in the narrowest of their widths that holds them all (int8 up to 128 experts); None when
    no row recorded any. A row without them stays -1: the trainer routes it on its own."""
    recorded = [t.result.routed_experts for _, t in rows if t.result.routed_experts is not None]
    if not recorded:
        return None
    shapes = {(r.layers, r.top_k) for r in recorded}
    if len(shapes) > 1:
        raise ValueError(f"trajectories record experts of different shapes (layers, top_k): "
                         f"{sorted(shapes)}")
    dtype = torch.int8 if all(r.ids.typecode == "b" for r in recorded) else torch.int16
    return torch.full((*size, *shapes.pop()), -1, dtype=dtype)


def split_for_ranks(batch: TrainBatch, ranks: int) -> list[TrainBatch]:
    """One sub-batch per data-parallel rank, balanced by loss tokens and trimmed of padding."""
    counts = batch.loss_mask.sum(dim=1).long().tolist()
    parts = []
    for rows in balanced_partition(counts, ranks):
        part = batch.select(torch.tensor(rows, dtype=torch.long))
        width = int(part.attention_mask.sum(dim=1).max().item()) if len(rows) else 0
        parts.append(part.select_columns(max(width, 1)))
    return parts

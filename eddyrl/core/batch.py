"""The tensors a training step consumes.

Layout: one row per trajectory, prompt then response, right-padded to a common length L.
Per-position tensors are aligned with `input_ids`: `logprobs[b, t]` is log p(input_ids[b, t] |
input_ids[b, :t]), so position 0 never carries a value. `loss_mask` is 1 exactly on the response
tokens that are trained (generated tokens; tool outputs and padding are 0).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(slots=True)
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long/bool, 1 on real tokens
    loss_mask: torch.Tensor  # [B, L] float, 1 on trained response tokens
    old_logprobs: torch.Tensor  # [B, L] float, behaviour-policy log-probs (0 off the mask)
    advantages: torch.Tensor  # [B, L] float, per-token advantages (0 off the mask)
    sample_weights: torch.Tensor  # [B] float, e.g. 1 fresh, tau replayed
    versions: torch.Tensor  # [B, L] long, policy version of each token (-1 off the mask)
    ref_logprobs: torch.Tensor | None = None  # [B, L] for the KL term, when enabled
    # [B, L] the proximal policy's log-probs (the trainer's weights at the start of this
    # optimizer step, before any update); given, the loss is decoupled PPO (core/losses.py)
    prox_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device) -> "TrainBatch":
        return TrainBatch(**{f.name: (None if getattr(self, f.name) is None
                                      else getattr(self, f.name).to(device))
                             for f in fields(self)})

    def select(self, rows: slice | torch.Tensor | list[int]) -> "TrainBatch":
        return TrainBatch(**{f.name: (None if getattr(self, f.name) is None
                                      else getattr(self, f.name)[rows])
                             for f in fields(self)})

    def select_columns(self, width: int) -> "TrainBatch":
        """The first `width` positions of every per-position tensor (drops trailing padding)."""
        return TrainBatch(**{f.name: _trim(getattr(self, f.name), width) for f in fields(self)})


def _trim(value: torch.Tensor | None, width: int) -> torch.Tensor | None:
    if value is None or value.dim() < 2:
        return value
    return value[:, :width]

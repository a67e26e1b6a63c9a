"""A LoRA weight update as it travels from the trainer to a rollout engine that merges it itself.

With `train.lora` on, only the adapted linears change, and each by a low-rank delta. Instead of
the merged weights, the trainer sends each adapted weight's two factors under the weight's own
Hugging Face name plus a suffix:

    <weight name>.lora_down   [rank, in_features]
    <weight name>.lora_up     [out_features, rank]   (peft's lora_B with alpha / rank folded in)

so that the weight to use is `base + up @ down`, where `base` is the weight the receiver had
before the first low-rank update (the run's base model: the trainer never changes it). Each
update carries the whole delta of its version, never a delta on the previous one: a receiver
that missed a version still ends up on the right weights. Weights an update does not name keep
their base. No peft and no torch model here: the hf engine (the receiver) imports this module.
"""

from __future__ import annotations

from typing import Iterable

import torch

DOWN = ".lora_down"
UP = ".lora_up"


def factor_names(weight: str) -> tuple[str, str]:
    """The names (down, up) that carry the factors of `weight`'s delta."""
    return weight + DOWN, weight + UP


def target_of(name: str) -> str | None:
    """The weight a factor's name belongs to; None for a name that is not a factor."""
    for suffix in (DOWN, UP):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return None


def targets(names: Iterable[str]) -> set[str]:
    """The weights a set of names brings low-rank factors for; a ValueError when a factor
    comes without its partner (an update cut short)."""
    names = set(names)
    out = {t for t in map(target_of, names) if t is not None}
    lonely = sorted(t for t in out if not set(factor_names(t)) <= names)
    if lonely:
        raise ValueError(f"low-rank update: {lonely[:3]} come with one factor of the two "
                         f"({DOWN}, {UP})")
    return out


def merged(base: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`base + up @ down`, in the base weight's dtype (the product is formed in fp32)."""
    delta = up.to(base.device, torch.float32) @ down.to(base.device, torch.float32)
    return (base.to(torch.float32) + delta).to(base.dtype)

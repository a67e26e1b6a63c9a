"""Activation checkpointing of decoder layers (`train.activation_checkpointing`).

Applied to the built model before `fully_shard`, as torchtitan does, and never inside model
code: each decoder layer's `forward` is replaced, on that instance, by the same forward run under
non-reentrant `torch.utils.checkpoint`. Replacing the bound method rather than wrapping the layer
in a module (torch's `checkpoint_wrapper`) keeps every parameter name the Hugging Face one, so
state_dict keys, exported weights, checkpoints and gradients by name are unchanged. FSDP2's
hooks run in the layer's `__call__`, around this forward: the gather before the forward and the
pre-backward gather are FSDP's as always, and the recompute in the backward runs on the weights
that pre-backward hook has just gathered.

- `full`: the layer keeps only its inputs; the backward reruns the whole layer.
- `selective`: the same, except that the attention kernel's outputs are kept (the op's output
  and its log-sum-exp, O(tokens x hidden)): the recompute skips the attention, the only part
  whose cost grows with the square of the sequence. Which op that is depends on the platform
  and the attention implementation, so the kernels are recognised by name: every op whose name
  holds `attention` or `attn` and is not a backward, e.g. `aten._scaled_dot_product_flash_
  attention_for_cpu` (what `sdpa` dispatches to on this torch's CPU, with or without a mask),
  `aten._scaled_dot_product_flash_attention` / `_efficient_attention` / `_cudnn_attention`,
  and the custom ops of flash-attn and vendor fused attention. transformers' `eager` attention
  is a matmul, a softmax and a matmul, no kernel: saving its softmax would keep the [S, S]
  probabilities that checkpointing exists to drop, so there `selective` recomputes everything,
  like `full` (logged).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Iterable

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from ...errors import ConfigError

log = logging.getLogger(__name__)

CHECKPOINTING_KINDS = ("none", "full", "selective")
ATTENTION_NAME_PARTS = ("attention", "attn")


def is_attention_kernel(op) -> bool:
    """Whether `op` (an OpOverload) is an attention kernel's forward, by its name."""
    name = op.name().lower()  # e.g. "aten::_scaled_dot_product_flash_attention_for_cpu"
    return "backward" not in name and any(part in name for part in ATTENTION_NAME_PARTS)


def _save_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_attention_kernel(op) else \
        CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_attention)


def _checkpointed(forward: Callable, context_fn, *args, **kwargs):
    if not torch.is_grad_enabled():  # log-prob passes: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    if kwargs.get("past_key_values") is not None:
        # a KV cache would be written again by the recompute, which would then attend to every
        # key twice; a training forward has no use for it (transformers drops it the same way)
        kwargs["past_key_values"] = None
    options = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)


def check_checkpointing(kind: str) -> str:
    if kind not in CHECKPOINTING_KINDS:
        raise ConfigError(f"activation_checkpointing = {kind!r}: must be one of "
                          f"{list(CHECKPOINTING_KINDS)}")
    return kind


def apply_activation_checkpointing(model: torch.nn.Module, layers: Iterable[torch.nn.Module],
                                   kind: str) -> None:
    """Checkpoint each of `layers` (the model's decoder layers) as `kind` says; call it after
    the model is built and before any `fully_shard`."""
    if check_checkpointing(kind) == "none":
        return
    context_fn = _selective_context if kind == "selective" else None
    if kind == "selective":
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if implementation == "eager":
            log.info("activation_checkpointing = selective with eager attention: no attention "
                     "kernel to keep, every op is recomputed (the same as full)")
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward, context_fn)

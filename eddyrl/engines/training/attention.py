"""Which attention a training forward runs packed sequences with (`train.attention`).

A micro-batch's forward packs its rows into fewer, longer sequences (packing.py), in one of two
layouts, and the model is loaded with the attention implementation its layout needs:

- `mask`, the shared-prompt layout: each distinct prompt once, its rows' responses after it,
  and a dense [S, S] block mask per pack saying who sees whom. Any implementation that takes a
  custom 4D mask runs it (transformers' `sdpa`, `eager`): every platform has one. The mask and
  the attention scores grow with the square of the pack.
- `varlen`: the rows' real tokens end to end in one sequence, `position_ids` restarting at 0 at
  each row, no mask: a variable-length kernel finds the rows from the positions and runs each
  causally on its own, with nothing of size [T, T]. Only where the platform has such a kernel
  (`Platform.varlen_attention`: flash-attn's varlen path on CUDA, `npu_fusion_attention` with
  actual sequence lengths on Ascend; none on the CPU).

`auto` takes `varlen` wherever the platform has it at the compute dtype, else `mask`. Why not
keep the shared prompt where a pack is short enough for its mask to be small: the model holds
one attention implementation, and a flash kernel takes no custom mask, so the choice is made
once per run, not per pack. Sharing the prompt saves the prompt's forward and backward for all
rows but one: (n - 1) / n of the prompt's share of the tokens. That is much of the work on the
default run (the shared-prompt layout runs 0.57 of the varlen layout's positions there:
bench/packing_layouts.py) but little where memory is the problem: the GPU
recipe's rows are up to 2,048 prompt + 20,480 response tokens, a prompt share of about a tenth
at full length, while its dense mask is 0.5-2 GB per pack and keeps sdpa off its flash kernel
(a custom mask sends it to the memory-efficient or math kernel). `mask` keeps the sharing where
the prompts are long and the responses short.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...hal import Platform

ATTENTION_KEY = "train.attention"


def attention_implementation(setting: str, platform: Platform, dtype: torch.dtype | None
                             ) -> str | None:
    """The `attn_implementation` to load the training model with for `setting` (auto, mask,
    varlen) on `platform` at compute dtype `dtype` (None: fp32): the platform's
    variable-length attention for the varlen layout, None (transformers' default, `sdpa`) for
    the mask layout. `varlen` where the platform has none is a ConfigError."""
    if setting not in ("auto", "mask", "varlen"):
        raise ConfigError(f"{ATTENTION_KEY} = {setting!r} is not one of auto, mask, varlen")
    if setting == "mask":
        return None
    dtype = dtype or torch.float32
    varlen = platform.varlen_attention(dtype)
    if varlen is None and setting == "varlen":
        in_bf16 = platform.varlen_attention(torch.bfloat16)
        hint = (f"it has {in_bf16} in bf16: set train.param_dtype=bf16" if in_bf16 else
                "use auto or mask (docs/platforms.md says which platforms have one and why)")
        raise ConfigError(f"{ATTENTION_KEY} = 'varlen': platform {platform.name!r} has no "
                          "variable-length attention at "
                          f"{str(dtype).removeprefix('torch.')}; {hint}")
    return varlen


def attention_layout(setting: str, platform: Platform, dtype: torch.dtype | None) -> str:
    """The packed layout a run with `setting` trains in on `platform`: `varlen` where
    `attention_implementation` loads a variable-length kernel, else `mask` (the one rule the
    engine and `eddy plan`'s memory model both follow)."""
    return "mask" if attention_implementation(setting, platform, dtype) is None else "varlen"

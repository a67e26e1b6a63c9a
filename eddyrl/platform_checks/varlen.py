"""Packed training's variable-length attention on the platform's device (`eddy platforms check
NAME --only varlen_attention`): the kernel `Platform.varlen_attention` names keeps the rows of
packing.py's varlen layout apart, at the precision it runs in."""

from __future__ import annotations

import torch

from ..hal import Platform
from .common import device_of
from .engines import ROWS, batch_layout, model_dir

# Largest |log-prob - fp32 row layout| of the varlen layout accepted, as a multiple of the
# half-precision row layout's own gap (which is rounding alone), with a floor for a device
# whose row layout happens to round very little. A row that sees its neighbours (a kernel that
# ignores the positions) moves the tiny model's log-probs by 0.3 or more.
ROUNDING_FACTOR, FLOOR = 2.0, 0.05


def check_varlen_attention(platform: Platform) -> str:
    """Where the platform has a variable-length attention for packed training: the tiny model
    in half precision with it, the rows end to end with positions restarting and no mask,
    gives each row's log-probs as closely to fp32 as the padded row layout in half precision
    does. A platform with none passes, saying so (packed training uses the dense mask)."""
    dtype = torch.bfloat16 if platform.supports_dtype(torch.bfloat16) else torch.float16
    implementation = platform.varlen_attention(dtype)
    name = str(dtype).removeprefix("torch.")
    if implementation is None:
        return f"none at {name}: packed training uses the dense block mask"
    reference = _logprobs(platform, None, torch.float32, varlen=False)
    rows = (_logprobs(platform, None, dtype, varlen=False) - reference).abs().max().item()
    packed = (_logprobs(platform, implementation, dtype, varlen=True) - reference
              ).abs().max().item()
    limit = max(ROUNDING_FACTOR * rows, FLOOR)
    assert packed <= limit, \
        f"{implementation} in {name}: the varlen layout's log-probs are {packed:.3g} from fp32 " \
        f"(limit {limit:.3g}; the padded rows in {name}: {rows:.3g}): does the kernel keep " \
        "the packed rows apart?"
    return f"{implementation} in {name}: max gap to fp32 {packed:.3g} (padded rows {rows:.3g})"


def _logprobs(platform: Platform, implementation: str | None, dtype: torch.dtype, *,
              varlen: bool) -> torch.Tensor:
    """[rows, length] log-probs of the ROWS batch on the device, 0 on padding: in the varlen
    layout, or in the padded row layout (transformers' default attention)."""
    from transformers import AutoModelForCausalLM

    from ..engines.training.packing import (micro_batches, micro_logprobs, place_rows,
                                            token_logprobs)
    from ..protocol import TrainBatch

    device = device_of(platform)
    input_ids, attention_mask, loss_mask = batch_layout(torch.Generator().manual_seed(0))
    zeros = torch.zeros(input_ids.shape)
    batch = TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       old_logprobs=zeros, advantages=zeros, sample_weights=torch.ones(len(ROWS)),
                       versions=torch.where(loss_mask > 0, 0, -1))
    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=dtype,
                                                 attn_implementation=implementation).to(device)
    out = torch.zeros(input_ids.shape)
    with torch.no_grad():
        if not varlen:
            values = token_logprobs(model, input_ids.to(device), attention_mask.to(device), 1.0)
            return torch.where(attention_mask.bool(), values.float().cpu(), 0.0)
        for micro in micro_batches(batch, len(ROWS), varlen=True):
            values = micro_logprobs(model, micro.to(device), 1.0).logprobs
            place_rows(out, micro.rows, micro.batch, values.float())
    return out

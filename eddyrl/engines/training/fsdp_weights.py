"""The FSDP engine's whole weights, out of its shards and into them: the export a weight sync
streams to the rollout workers (with LoRA, the adapted weights merged, or only their factors),
its size, and the whole weights a rebuilt trainer takes from the rollout's. `engine`: an
`FSDPTrainEngine` (fsdp.py), whose methods of the same names call these.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ... import fault_points
from ...errors import EddyError
from ...hal import distributed as hd
from ...hal import iter_buckets
from . import lora as lora_layers
from .offload import full_tensor


@torch.no_grad()
def export_weights(engine: Any, bucket_bytes: int, *, low_rank: bool = False
                   ) -> Iterator[dict[str, torch.Tensor]]:
    """Every rank must drain the iterator: each tensor is gathered when rank 0 reaches it.
    With LoRA, `low_rank` sends only the adapted weights' factors (engines/low_rank.py),
    for a receiver that merges them itself; else every weight, the adapted ones merged.
    `export_bytes` says how many bytes that is."""
    fault_points.reached("weight_export", engine.rank, engine.version)
    if engine.lora is None:
        named = full_tensors(engine.model)
    else:
        named = lora_layers.weight_update(
            full_tensors(engine.model, lora_layers.is_adapter if low_rank else None),
            lora_layers.scaling(engine.lora), factors=low_rank)
    if engine.rank != 0:
        for _ in named:  # still take part in every gather
            pass
        return
    yield from iter_buckets(named, bucket_bytes)


def export_bytes(engine: Any, *, low_rank: bool = False) -> int:
    """The bytes `export_weights(low_rank=...)` sends, from the shapes alone (no gather):
    LoRA's factors have the adapter's shapes; merged weights are the whole model's."""
    if engine.lora is None or not low_rank:
        return engine.full_sync_bytes
    return sum(t.numel() * t.element_size() for name, t in engine.model.state_dict().items()
               if lora_layers.is_adapter(name))


def full_tensors(model: torch.nn.Module, include: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF names and full tensors, gathered one at a time so only one bucket is resident
    (`include`: only the names it accepts, the rest not gathered). A tied weight appears
    under both names (HF state_dict keys); gathering it twice is the price of not holding
    it until its alias comes round."""
    for name, tensor in model.state_dict().items():
        if include is None or include(name):
            yield name, full_tensor(tensor)


def load_full_weights(engine: Any, full: dict[str, torch.Tensor], version: int) -> bool:
    """Collective: the whole weights, held by rank 0 alone (the others pass {}), into
    every rank's shards, cast to the model's dtypes; the engine is then at `version`.
    A trainer rebuilt without buddy copies takes the rollout's weights so
    (runtime/ray/published_rebuild.py); its optimizer state is a checkpoint's. Returns
    whether rank 0 had every weight in the model's dtype (no rounding came with them)."""
    exact = True
    if engine.rank == 0:
        targets = engine.model.state_dict()
        missing = sorted(targets.keys() - full.keys())
        if missing:
            raise EddyError(f"the weights given back for version {version} lack "
                            f"{missing[:3]} ({len(missing)} of {len(targets)})")
        exact = all(full[name].dtype == t.dtype for name, t in targets.items())
        full = {name: full[name].to(t.dtype) for name, t in targets.items()}
    set_model_state_dict(engine.model, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=True))
    engine.version = version
    hd.barrier()
    return exact

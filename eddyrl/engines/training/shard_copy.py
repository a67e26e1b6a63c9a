"""A trainer rank's shard of its training state, as buddy replication (buddy.py) copies it:
collected from the live engine, laid out in one flat host buffer (one send, one receive), and
loaded back into a fresh engine of the same rank.

Keys: `param/<name>` (the rank's local shard of a trainable parameter: FSDP2's DTensor local
tensor), `optim/<name>/<state key>` (that parameter's optimizer state: AdamW's moments, sharded
like it, and its step count, a host scalar), `rng/<generator>` (the platform's generators).
Frozen weights (LoRA's base) are not copied: a fresh engine reads them from the model's files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import EddyError

ALIGN = 64  # bytes: every tensor's view of the flat buffer starts aligned for its dtype
PARAM, OPTIM, RNG = "param/", "optim/", "rng/"

NamedTensors = list[tuple[str, torch.Tensor]]

# ---- the flat layout ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    dtype: str  # torch's name without "torch.": float32, uint8 ...
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each named tensor lives in one flat uint8 buffer: one send, one receive."""

    entries: tuple[Entry, ...]
    nbytes: int

    @classmethod
    def of(cls, named: NamedTensors) -> "Layout":
        entries, offset = [], 0
        for key, tensor in named:
            entry = Entry(key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                          offset)
            entries.append(entry)
            offset += -(-entry.nbytes // ALIGN) * ALIGN
        return cls(tuple(entries), offset)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        if buffer.numel() < self.nbytes:
            raise ValueError(f"a buffer of {buffer.numel()} bytes for a layout of {self.nbytes}")
        return {e.key: buffer[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)
                for e in self.entries}

    def to_bytes(self) -> bytes:
        return json.dumps([[e.key, e.dtype, list(e.shape), e.offset] for e in self.entries]
                          + [self.nbytes]).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Layout":
        *entries, nbytes = json.loads(data)
        return cls(tuple(Entry(k, d, tuple(s), o) for k, d, s, o in entries), nbytes)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a buddy copy's layout")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


# ---- the state of one rank ---------------------------------------------------------------
@dataclass(frozen=True)
class ShardCopy:
    """Rank `rank`'s state after its step to `version`: `tensors` by key (`param/<name>`,
    `optim/<name>/<state key>`, `rng/<generator>`), on the host."""

    rank: int
    version: int
    tensors: dict[str, torch.Tensor]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def shard_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                platform: Any) -> NamedTensors:
    """This rank's live state, not copied: its shard of each trainable parameter, that
    parameter's optimizer state, and its RNG generators."""
    out: NamedTensors = []
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    for name, param in trainable:
        out.append((PARAM + name, _local(param)))
    for name, param in trainable:
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                out.append((f"{OPTIM}{name}/{key}", _local(value)))
    out += [(RNG + name, tensor) for name, tensor in platform.get_rng_state().items()]
    return out


@torch.no_grad()
def load_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, platform: Any,
               copy: ShardCopy) -> None:
    """`copy` into a fresh engine's model, optimizer and generators: the same rank of the same
    world (so the same shard shapes). Optimizer state is made like AdamW makes it (moments
    like the parameter, a DTensor where it is one; the step count as saved), then filled."""
    params = {PARAM + name: p for name, p in model.named_parameters() if p.requires_grad}
    known = set(params) | {k for k in copy.tensors if k.startswith(RNG)}
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, saved in copy.tensors.items():
        if key.startswith(OPTIM):
            name, state_key = key[len(OPTIM):].rsplit("/", 1)
            by_param.setdefault(PARAM + name, {})[state_key] = saved
            known.add(key)
    unknown = sorted(set(copy.tensors) - known
                     | {k for k in by_param if k not in params})
    missing = sorted(set(params) - set(copy.tensors))
    if unknown or missing:
        raise EddyError(f"rank {copy.rank}'s copy (version {copy.version}) does not fit this "
                        f"model: unknown {unknown[:3]}, missing {missing[:3]}")
    for key, param in params.items():
        _fill(key, _local(param), copy.tensors[key])
    optimizer.state.clear()
    for key, saved_state in by_param.items():
        param = params[key]
        state = {}
        for state_key, saved in saved_state.items():
            if saved.dim() == 0:  # AdamW's step: a host scalar, kept as saved
                state[state_key] = saved.clone()
            else:
                state[state_key] = torch.zeros_like(param, memory_format=torch.preserve_format)
                _fill(f"{key} {state_key}", _local(state[state_key]), saved)
        optimizer.state[param] = state
    platform.set_rng_state({k[len(RNG):]: t for k, t in copy.tensors.items()
                            if k.startswith(RNG)})


def _fill(key: str, local: torch.Tensor, saved: torch.Tensor) -> None:
    if local.shape != saved.shape or local.dtype != saved.dtype:
        raise EddyError(f"{key}: this rank's shard is {tuple(local.shape)} {local.dtype}, the "
                        f"copy's {tuple(saved.shape)} {saved.dtype} (another rank's or world's?)")
    local.copy_(saved)


# ---- another world's shard, from the copies of the old one --------------------------------
Shapes = dict[str, tuple[int, ...]]


def shapes_of(copy: ShardCopy) -> Shapes:
    return {key: tuple(tensor.shape) for key, tensor in copy.tensors.items()}


def rows_of(rank: int, world_size: int, rows: int) -> tuple[int, int]:
    """The rows [start, end) of a dim-0 size `rows` that `rank` of `world_size` holds, as
    FSDP2 shards (torch.chunk: chunks of ceil(rows / world), the last ones short or empty)."""
    chunk = -(-rows // world_size)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def reshard(shapes: list[Shapes], fetch: Any, world_size: int, rank: int, rng_from: int,
            version: int) -> ShardCopy:
    """Rank `rank`'s copy in a world of `world_size`, from the copies of every rank of the
    old world (their `shapes` in old rank order, `fetch(i)` the copy of old rank i, fetched
    only where its rows are needed). A parameter's (and its moments') rows are FSDP2's dim-0
    chunks, in rank order: the old ranks' pieces end to end are the whole tensor, and the new
    rank's chunk of it is cut from the pieces it overlaps. Scalars (AdamW's step, the same on
    every rank) and generators come from old rank `rng_from`. In a world of the old size each
    rank's chunk is exactly its old piece: the copy comes back bit for bit, unsliced."""
    fetched: dict[int, ShardCopy] = {}

    def piece(old: int) -> ShardCopy:
        if old not in fetched:
            fetched[old] = fetch(old)
            if fetched[old].version != version:
                raise EddyError(f"old rank {old}'s copy is of version {fetched[old].version}, "
                                f"not {version}")
        return fetched[old]

    keys = list(shapes[0])
    for old, other in enumerate(shapes):
        if list(other) != keys:
            raise EddyError(f"old rank {old}'s copy holds other tensors than old rank 0's: "
                            f"{sorted(set(other) ^ set(keys))[:3]}")
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        if key.startswith(RNG) or len(shapes[0][key]) == 0:
            out[key] = piece(rng_from).tensors[key]
            continue
        sizes = [s[key][0] for s in shapes]
        start, end = rows_of(rank, world_size, sum(sizes))
        parts, offset = [], 0
        for old, size in enumerate(sizes):
            lo, hi = max(start, offset), min(end, offset + size)
            if lo < hi:
                tensor = piece(old).tensors[key]
                parts.append(tensor if (lo, hi) == (offset, offset + size)
                             else tensor[lo - offset:hi - offset])
            offset += size
        if len(parts) == 1:
            out[key] = parts[0]
        elif parts:
            out[key] = torch.cat(parts)
        else:  # this rank's chunk of a short tensor is empty: its shape and dtype from the
            out[key] = piece(rng_from).tensors[key][:0]  # copy fetched for its generators
    return ShardCopy(rank, version, out)

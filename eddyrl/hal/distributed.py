"""Collective helpers over the default process group that the platform initialised.

Thin on purpose: the composite backend (`cpu:gloo,<device>:<backend>`) already routes each tensor
to the right library, so these helpers only add what every caller would otherwise repeat.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG}


# How the backends word a collective that waited past its group's timeout (the `timeout_s` of
# `Platform.init_process_group`): gloo "Timed out waiting 20000ms for recv operation to
# complete", NCCL's watchdog "... ran for 20000 milliseconds before timing out", torch's
# stores "... timed out after ...".
_TIMED_OUT = re.compile(r"\btimed out\b|\btiming out\b", re.IGNORECASE)


def timed_out(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from, is a collective (or the group's
    store) that waited past the group's timeout. The backends raise RuntimeError (torch's
    DistError family is one) with the words above; any other type is not theirs."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and _TIMED_OUT.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """In place on every rank; returns the tensor for chaining."""
    if is_initialized():
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    if op not in _OPS:
        raise ValueError(f"all_reduce op {op!r} is not one of {sorted(_OPS)}")
    if is_initialized():
        if op == "avg":
            # Not every backend has AVG (gloo does not): sum, then divide, everywhere.
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
            tensor.div_(dist.get_world_size(group))
        else:
            dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """One tensor per rank, in rank order (same shape on every rank)."""
    if not is_initialized():
        return [tensor.clone()]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def all_gather_object(obj, group=None) -> list:
    if not is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    if is_initialized():
        dist.barrier(group=group)


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()


def abandon() -> None:
    """Leave a group one of whose members was lost, so that a new one can form: NCCL's
    communicators are aborted first (their pending work would otherwise wait on the lost
    member in the device's queue, and `destroy_process_group` with it); gloo's connections
    to the lost member are closed already, and destroying the group is enough."""
    if not is_initialized():
        return
    if "nccl" in str(dist.get_backend()):
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()  # every group of this process, the default one last
    else:
        dist.destroy_process_group()

"""Weights straight from the trainer's broadcast into vLLM's workers, device to device.

With a `collective` weight channel (trainer and rollout on like accelerators), every vLLM worker
of the engine (one per tensor-/pipeline-parallel rank) joins the trainer's standalone broadcast
group itself, as rank `rank_offset + worker rank` (the trainer is rank 0 and sends, unchanged),
and receives each bucket into fresh buffers on its own device. The buffers become the staged
weights, applied by the same single in-place reload as buckets that came through host memory
(weights.py), so the version semantics do not change: a busy engine keeps hosting its
version with the new one staged (on the device: one more copy of the weights in device memory
until it applies). The group is made by the HAL inside the worker (`CollectiveChannel.connect`:
loopback variables for a one-machine rendezvous, `make_store`, `Platform.new_standalone_group`),
so NCCL on NVIDIA, HCCL on Ascend, gloo on a CPU run forced to `train.weight_channel=collective`.
The broadcasts run on the backend's stream while the engine keeps stepping; the staged copy
waits for them before it counts as received.

Why not vLLM's native weight-transfer API (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`; backends nccl / hccl): its `update_weights` loads each
chunk into the live model between `start_` and `finish_weight_update` (a layer-wise reload that
leaves layers unusable until their last tensor arrives), so the engine must stop generating
for the whole transfer, and a busy engine cannot keep serving its version with the next one
staged, which the delayed (C1) and multi-version updates need. Its trainer side also opens a
group of its own (vLLM's stateless group on `master_address:master_port`, or vllm-ascend's
for HCCL) instead of the HAL group every other engine's weights travel through, and its
signatures differ between releases (0.23: `start_weight_update(is_checkpoint_format)` and a
`finish_weight_update()` without a version). Receiving into buffers and reloading once needs
only `collective_rpc` and `torch.distributed`, the same in every release.

This module is imported by vLLM's engine-core process (`WorkerExtension` is the worker
extension class): no vLLM import, no adapter import, at module level.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Sequence

import torch

from .weights import WeightStaging, worker_device
from .weights_back import WeightsBack

logger = logging.getLogger(__name__)

PlainSpec = tuple[list[str], list[str], list[list[int]]]  # names, dtype names, shapes


# ---- adapter side ----------------------------------------------------------------------------
RpcAll = Callable[..., Awaitable[list]]  # collective_rpc by method name: one result per worker


def plain_spec(spec) -> PlainSpec:
    """A `WeightBucketSpec`'s layout as plain values (what vLLM's RPC carries reliably)."""
    return (list(spec.names), [str(d).removeprefix("torch.") for d in spec.dtypes],
            [list(shape) for shape in spec.shapes])


async def connect(rpc_all: RpcAll, platform_name: str, rendezvous: str, rank_offset: int,
                  world_size: int, timeout_s: float, address: str | None = None) -> list[int]:
    """Every worker joins the group; returns their ranks (checked to be distinct, in range).
    `address`: the node's cluster address (the workers run on the adapter's node), where a
    `tcp://` group's sockets go."""
    ranks = await rpc_all("eddy_connect_weights", platform_name, rendezvous, rank_offset,
                          world_size, timeout_s, address)
    if len(set(ranks)) != len(ranks) or not all(0 < r < world_size for r in ranks):
        raise RuntimeError(f"vLLM workers took weight-group ranks {ranks} (offset "
                           f"{rank_offset}, world size {world_size}): not distinct ranks "
                           "after the sender's")
    return ranks


async def receive(rpc_all: RpcAll, specs: Sequence) -> set[str]:
    """Post every bucket's broadcasts in the workers (each into its incoming copy); returns
    the names received. All buckets are received even when some names are wrong: a rank
    that stops taking part in the broadcast would leave the sender waiting forever."""
    names: set[str] = set()
    for spec in specs:
        names.update(spec.names)
        await rpc_all("eddy_receive", *plain_spec(spec))
    return names


async def close(rpc_all: RpcAll) -> None:
    await rpc_all("eddy_close_weights")


# ---- worker side -----------------------------------------------------------------------------
class WeightReceiver:
    """Mixed into vLLM's worker (`self` is the worker): its rank in the weight broadcast group
    and the broadcasts it has posted but not yet waited for."""

    def eddy_connect_weights(self, platform_name: str, rendezvous: str, rank_offset: int,
                             world_size: int, timeout_s: float,
                             address: str | None = None) -> int:
        from ....hal import get_platform
        from ....hal.weight_channel import CollectiveChannel

        self.eddy_close_weights()  # a new group replaces the old one
        rank = rank_offset + self.rank  # the worker's rank among the engine's workers
        self._eddy_channel = CollectiveChannel.connect(get_platform(platform_name), rendezvous,
                                                       rank, world_size, timeout_s,
                                                       address=address)
        return rank

    def eddy_receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]
                     ) -> int:
        """Post this bucket's broadcasts into new buffers on the worker's device and keep them
        as incoming; returns the number of tensors incoming so far."""
        channel = getattr(self, "_eddy_channel", None)
        if channel is None:
            raise RuntimeError("eddy_receive before eddy_connect_weights")
        device = worker_device(self)
        pending = self.__dict__.setdefault("_eddy_pending", [])
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            pending.append(channel.group.broadcast(tensor, 0))
            self._eddy_incoming[name] = tensor
        return len(self._eddy_incoming)

    def eddy_begin_staging(self) -> None:
        self._eddy_settle(raise_errors=False)
        super().eddy_begin_staging()

    def eddy_drop_incoming(self) -> None:
        # The buffers may be written still: free them only once their broadcasts are done.
        self._eddy_settle(raise_errors=False)
        super().eddy_drop_incoming()

    def eddy_commit_staged(self) -> None:
        self._eddy_settle(raise_errors=True)
        super().eddy_commit_staged()

    def eddy_close_weights(self) -> None:
        channel = self.__dict__.pop("_eddy_channel", None)
        if channel is not None:
            self._eddy_settle(raise_errors=False)
            channel.close()

    def _eddy_settle(self, raise_errors: bool) -> None:
        """Wait for the posted broadcasts: on a device backend the current stream waits (the
        reload that reads the buffers runs after them), on gloo the host waits."""
        pending, self._eddy_pending = self.__dict__.get("_eddy_pending", []), []
        for work in pending:
            try:
                work.wait()
            except Exception:
                if raise_errors:
                    raise
                logger.exception("a weight broadcast failed while its update was dropped")


class WorkerExtension(WeightReceiver, WeightStaging, WeightsBack):
    """The class vLLM mixes into its worker (`worker_extension_cls`)."""

"""How new weights travel from the trainer to the inference engines.

Three channels; `choose_weight_channel(sender, receiver)` takes the best both platforms support
(`Platform.weight_channels`), `host` where they share none:
- `collective`: trainer and rollout workers on the same accelerator kind join a standalone
  process group over the device backend (NCCL, HCCL); buckets are broadcast device to device.
- `object_store`: CPU to CPU; buckets are plain host tensors handed over by the runtime (Ray puts
  them in its shared-memory object store, so co-located readers map them without a copy).
- `host`: different platforms (e.g. trainer on NVIDIA, rollout on Ascend): staged through host
  memory the same way, then copied onto the receiver's device.

A transfer is a sequence of buckets. For each, the sender calls `describe(bucket)` to get a
`WeightBucketSpec` the runtime delivers to the receivers, and `send(bucket)`; each receiver calls
`receive(spec)`. For `collective`, `send` and `receive` are the two ends of a broadcast and must
run concurrently; for the host channels the spec carries the tensors and `send` does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from .base import Platform, choose_weight_channel
from .rendezvous import make_store


@dataclass(slots=True)
class WeightBucketSpec:
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    tensors: dict[str, torch.Tensor] | None = None  # host channels only
    nbytes: int = 0


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors into buckets of about `bucket_bytes` (a larger tensor gets its own)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


def _spec(bucket: dict[str, torch.Tensor]) -> WeightBucketSpec:
    return WeightBucketSpec(names=list(bucket), dtypes=[t.dtype for t in bucket.values()],
                      shapes=[tuple(t.shape) for t in bucket.values()],
                      nbytes=sum(t.numel() * t.element_size() for t in bucket.values()))


class WeightChannel:
    kind = "abstract"

    def describe(self, bucket: dict[str, torch.Tensor]) -> WeightBucketSpec:
        raise NotImplementedError

    def send(self, bucket: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def receive(self, spec: WeightBucketSpec) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass
class HostChannel(WeightChannel):
    """Through host memory: the spec carries contiguous CPU tensors."""

    receiver: Platform
    kind: str = "object_store"

    def describe(self, bucket: dict[str, torch.Tensor]) -> WeightBucketSpec:
        spec = _spec(bucket)
        spec.tensors = {name: t.detach().to("cpu").contiguous() for name, t in bucket.items()}
        return spec

    def send(self, bucket: dict[str, torch.Tensor]) -> None:
        pass  # the spec already holds the data

    def receive(self, spec: WeightBucketSpec) -> dict[str, torch.Tensor]:
        if spec.tensors is None:
            raise ValueError("host weight channel got a bucket spec without tensors")
        device = self.receiver.device(self.receiver.local_rank())
        return {name: t.to(device, non_blocking=False) for name, t in spec.tensors.items()}


@dataclass
class CollectiveChannel(WeightChannel):
    """Broadcast from rank 0 (the trainer) over a standalone group on the device backend."""

    platform: Platform
    group: Any
    rank: int
    kind: str = "collective"
    _pending: list = field(default_factory=list)

    @classmethod
    def connect(cls, platform: Platform, rendezvous: str, rank: int, world_size: int,
                timeout_s: float = 600.0, *, store: Any = None,
                address: str | None = None) -> "CollectiveChannel":
        """All ranks call this with the same `rendezvous` (see `hal.rendezvous`); rank 0
        sends, and with a `tcp://` one passes the `store` it serves. `address`: this node's
        cluster address, where the sockets go (a `file://` rendezvous keeps them on
        loopback)."""
        if rendezvous.startswith("file://"):
            platform.use_network(None)
        elif address is not None:
            platform.use_network(address)
        if store is None:
            store = make_store(rendezvous, rank, world_size, timeout_s)
        group = platform.new_standalone_group(store, rank, world_size, timeout_s)
        return cls(platform=platform, group=group, rank=rank)

    def describe(self, bucket: dict[str, torch.Tensor]) -> WeightBucketSpec:
        return _spec(bucket)

    def send(self, bucket: dict[str, torch.Tensor]) -> None:
        device = self.platform.device(self.platform.local_rank())
        for tensor in bucket.values():
            self.group.broadcast(tensor.detach().to(device).contiguous(), 0).wait()

    def receive(self, spec: WeightBucketSpec) -> dict[str, torch.Tensor]:
        device = self.platform.device(self.platform.local_rank())
        out = {}
        for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            self.group.broadcast(tensor, 0).wait()
            out[name] = tensor
        return out

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            shutdown()


def open_weight_channel(sender: Platform, receiver: Platform, *, rank: int = 0,
                        world_size: int = 1, rendezvous: str = "", kind: str = "auto",
                        timeout_s: float = 600.0, store: Any = None,
                        address: str | None = None) -> WeightChannel:
    """The channel the two platforms agree on (`choose_weight_channel`), or `kind` when
    forced. `rank` 0 is the sender; the rendezvous arguments (`store`, `address`: see
    `CollectiveChannel.connect`) matter only for `collective`."""
    if kind == "auto":
        kind = choose_weight_channel(sender, receiver)
    if kind not in ("collective", "object_store", "host"):
        raise ValueError(f"weight channel kind {kind!r} is not collective, object_store or host")
    if kind == "collective":
        own = sender if rank == 0 else receiver
        return CollectiveChannel.connect(own, rendezvous, rank, world_size, timeout_s,
                                         store=store, address=address)
    return HostChannel(receiver=receiver, kind=kind)

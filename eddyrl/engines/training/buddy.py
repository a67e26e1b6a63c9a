"""Buddy replication: each trainer rank's shard of the training state in a peer's host memory,
refreshed after every RL step, so that a lost rank is rebuilt without a checkpoint.

- Ring: rank r's copy is kept by rank (r + 1) % world, its buddy; r keeps the copy of
  (r - 1) % world, its ward. One rank has no buddy: nothing is copied.
- What (shard_copy.py): the rank's local shards (FSDP2's DTensor local tensors) of every
  trainable parameter and of its optimizer state (AdamW's moments and step count), and the
  rank's RNG state: with the model's files (the frozen weights: LoRA's base) everything a fresh
  engine of the same rank needs to take the next step as the lost one would have, bit for bit.
- When: `replicate(version)` at the end of each RL step (`FSDPTrainEngine.snapshot`, called
  by the trainer rank once the step's optimizer steps and metrics are done: a copy is of a
  step boundary, never of the middle of a step), at start, after a checkpoint's load and
  after a rebuild. On the trainer's critical path:
  the copy of the shards into a host staging buffer (pinned, on a side stream where the
  platform has a device: `Platform.copy_to_host_async`), and a wait for the previous round if
  it is still running. Off it: a background thread waits for that copy to land, then sends the
  staging buffer to the buddy and receives the ward's, each copy stamped with its version.
- How: gloo, on a process group of its own, from that thread. The copy lives in host memory at
  both ends, and gloo moves host memory; NCCL / HCCL move device memory, which would need a
  device staging buffer at each end (the memory a trainer is short of) and a second
  communicator. A group of its own because a process group matches operations by the order
  each rank issues them: the trainer issues its own host-tensor collectives (token counts,
  metrics) on the default group at moments this thread cannot know, so sharing that group
  would interleave the two differently on different ranks. A thread rather than isend / irecv
  issued by the trainer: the send may start only once the non-blocking device copy has
  landed, and something must wait for that.
- Ordering: a round starts only after the previous one completed (the staging buffer is
  reused; a buddy never receives two versions interleaved), and the optimizer's pre-step hook
  waits for the previous copy to land (its sources are about to change).
- Memory: per rank, its own shard's bytes twice: the staging buffer and the ward's copy
  (`host_bytes`).

The window: while version N's copy travels, the ward's previous copy is being overwritten, so
`held_version` is None; it is N once the copy has arrived. A rank lost inside that window
(at most `transfer_s` after its step's end; a weight export and a checkpoint write wait for it
first, `settle`) has no usable copy: the survivors' copies are of N, the buddy's of none, and
the run ends (runtime/ray/trainer_rebuild.py). Keeping N - 1 would not help without every
survivor also keeping its own N - 1.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ...errors import EddyError
from .shard_copy import Layout, NamedTensors, ShardCopy, load_shard, shard_state

log = logging.getLogger(__name__)


def buddy_of(rank: int, world_size: int) -> int | None:
    """The rank that keeps `rank`'s copy; None alone (no peer to keep it)."""
    return (rank + 1) % world_size if world_size > 1 else None


def ward_of(rank: int, world_size: int) -> int | None:
    """The rank whose copy `rank` keeps."""
    return (rank - 1) % world_size if world_size > 1 else None


# ---- moving copies -----------------------------------------------------------------------
class Transport(Protocol):
    def exchange(self, version: int, layout: bytes, data: torch.Tensor
                 ) -> tuple[int, bytes, torch.Tensor]:
        """Send (version, layout, data) to the buddy; return what the ward sent."""

    def close(self) -> None: ...


class RingTransport:
    """Point-to-point on a gloo group of its own (module docstring: why), made on the
    trainer's thread (`new_group` is collective), used only by the store's thread."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        self._dist = dist
        self.group = dist.new_group(backend="gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.buddy, self.ward = buddy_of(rank, world_size), ward_of(rank, world_size)
        self._received: torch.Tensor | None = None  # the ward's copy: reused while it fits

    def exchange(self, version: int, layout: bytes, data: torch.Tensor
                 ) -> tuple[int, bytes, torch.Tensor]:
        header = torch.tensor([version, len(layout), data.numel()], dtype=torch.int64)
        theirs = self._both(header, torch.empty(3, dtype=torch.int64))
        their_version, layout_bytes, data_bytes = theirs.tolist()
        their_layout = self._both(torch.frombuffer(bytearray(layout), dtype=torch.uint8),
                                  torch.empty(layout_bytes, dtype=torch.uint8))
        if self._received is None or self._received.numel() != data_bytes:
            self._received = None  # drop the old before the new one exists
            self._received = torch.empty(data_bytes, dtype=torch.uint8)
        self._both(data, self._received)
        return their_version, their_layout.numpy().tobytes(), self._received

    def _both(self, send: torch.Tensor, receive: torch.Tensor) -> torch.Tensor:
        dist = self._dist
        for work in dist.batch_isend_irecv([
                dist.P2POp(dist.isend, send, self.buddy, self.group),
                dist.P2POp(dist.irecv, receive, self.ward, self.group)]):
            work.wait()
        return receive

    def close(self) -> None:
        self._dist.destroy_process_group(self.group)


@dataclass
class BuddyStats:
    """The last round's costs: `copy_s` and `wait_s` on the trainer's critical path (the copy
    into the staging buffer; waiting for the previous round), `transfer_s` in the background;
    `fence_s`: the last wait at a weight export or a checkpoint write for the round to land
    (`settle`), on the critical path too; `host_bytes`: this rank's staging buffer plus the
    ward's copy."""

    rounds: int = 0
    copy_s: float = 0.0
    wait_s: float = 0.0
    fence_s: float = 0.0
    transfer_s: float = 0.0
    host_bytes: int = 0
    totals: dict[str, float] = field(default_factory=lambda: {
        "copy_s": 0.0, "wait_s": 0.0, "transfer_s": 0.0})


class BuddyStore:
    """This rank's side of the ring: sends its own copy each round, keeps its ward's.
    `collect`: the live state to copy (`shard_state`); `connect`: makes the transport, called
    on the trainer's thread at the first round (every rank reaches it at the same step)."""

    def __init__(self, rank: int, world_size: int, platform: Any,
                 collect: Callable[[], NamedTensors], connect: Callable[[], Transport]) -> None:
        if world_size < 2:
            raise ValueError(f"buddy replication needs 2 or more ranks, not {world_size}")
        self.rank, self.world_size, self.platform = rank, world_size, platform
        self.buddy, self.ward = buddy_of(rank, world_size), ward_of(rank, world_size)
        self._collect, self._connect = collect, connect
        self._transport: Transport | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eddy-buddy")
        self._pending: Future | None = None
        self._copied: Any = None  # the last copy's event
        self._layout: Layout | None = None
        self._staging: torch.Tensor | None = None
        self._staged_version: int | None = None  # of this rank's own copy in the staging buffer
        self._held: ShardCopy | None = None  # the ward's last complete copy
        self._lock = threading.Lock()
        self.stats = BuddyStats()

    def replicate(self, version: int) -> None:
        """At a step's end, with the state of `version`: copy this rank's state to the
        host and send it to the buddy in the background."""
        start = time.perf_counter()
        self.flush()  # the staging buffer is free again, the ward's copy complete
        waited = time.perf_counter() - start
        if self._transport is None:
            self._transport = self._connect()
        state = self._collect()
        layout = Layout.of(state)
        if layout != self._layout:  # the first round, or the optimizer's state appeared
            self._staging = None
            self._staging = self.platform.host_buffer(layout.nbytes)
            self._layout = layout
        views = layout.views(self._staging)
        self._staged_version = None  # being overwritten until the copy lands
        self._copied = self.platform.copy_to_host_async([(t, views[k]) for k, t in state])
        self._staged_version = version
        self.stats.wait_s, self.stats.copy_s = waited, time.perf_counter() - start - waited
        self._pending = self._pool.submit(self._transfer, version, layout, self._copied)

    def _transfer(self, version: int, layout: Layout, copied: Any) -> None:
        start = time.perf_counter()
        copied.synchronize()
        with self._lock:
            self._held = None  # the receive overwrites it
        their_version, their_layout, data = self._transport.exchange(
            version, layout.to_bytes(), self._staging)
        received = Layout.from_bytes(their_layout)
        with self._lock:
            self._held = ShardCopy(self.ward, their_version, received.views(data))
        stats = self.stats
        stats.transfer_s = time.perf_counter() - start
        stats.host_bytes = layout.nbytes + data.numel()
        stats.rounds += 1
        for key in stats.totals:
            stats.totals[key] += getattr(stats, key)

    def wait_copied(self) -> None:
        """Before the optimizer changes the state: the last copy has landed."""
        if self._copied is not None:
            self._copied.synchronize()

    def settle(self) -> None:
        """`flush`, timed (`stats.fence_s`): before a weight export or a checkpoint write."""
        start = time.perf_counter()
        self.flush()
        self.stats.fence_s = time.perf_counter() - start

    def flush(self) -> None:
        """Wait for the round in flight; its failure is raised here, naming the buddy."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:
            raise EddyError(f"buddy replication from rank {self.rank} to rank {self.buddy} "
                            f"(and from rank {self.ward}) failed: {type(exc).__name__}: {exc}"
                            ) from exc

    @property
    def held_version(self) -> int | None:
        """The version of the ward's copy held now; None while one is arriving (or before)."""
        with self._lock:
            return None if self._held is None else self._held.version

    def copies(self) -> tuple[ShardCopy | None, ShardCopy | None]:
        """What a rebuild after a lost rank starts from: this rank's own last copy (as it was
        sent, generators included) and its ward's, each None where there is none; clones, so
        that closing the store frees nothing under them. The round in flight is waited for
        first; its failure (a lost peer) is expected here and only logged."""
        try:
            self.flush()
        except EddyError as exc:
            log.warning(f"{exc}")
        self.wait_copied()
        own = None
        if self._staged_version is not None and self._layout is not None:
            own = ShardCopy(self.rank, self._staged_version,
                            {k: v.clone() for k, v in self._layout.views(self._staging).items()})
        with self._lock:
            held = self._held
        ward = None if held is None else ShardCopy(
            held.rank, held.version, {k: v.clone() for k, v in held.tensors.items()})
        return own, ward

    def restore(self, lost_rank: int, version: int) -> ShardCopy:
        """The copy of `lost_rank` (this rank's ward) at `version`, cloned out of the buffer."""
        if lost_rank != self.ward:
            raise EddyError(f"rank {self.rank} keeps the copy of rank {self.ward}, not of rank "
                            f"{lost_rank} (its copy is on rank "
                            f"{buddy_of(lost_rank, self.world_size)})")
        with self._lock:
            held = self._held
            if held is None:
                raise EddyError(f"rank {self.rank} holds no complete copy of rank {lost_rank}: "
                                "none has arrived yet, or one was arriving when it was lost")
            if held.version != version:
                raise EddyError(f"rank {self.rank} holds rank {lost_rank}'s copy of version "
                                f"{held.version}, not {version}")
            return ShardCopy(held.rank, held.version,
                             {k: v.clone() for k, v in held.tensors.items()})

    def close(self) -> None:
        try:
            self.flush()
        except EddyError as exc:  # a peer already gone: nothing left to keep
            log.warning(f"{exc}")
        self._pool.shutdown(wait=True)
        if self._transport is not None:
            self._transport.close()
            self._transport = None


def engine_store(engine: Any, timeout_s: float) -> BuddyStore | None:
    """The store of an FSDP engine (fsdp.py), or None for a single rank; its optimizer waits
    for each copy before stepping."""
    if engine.world_size < 2:
        return None
    store = BuddyStore(
        engine.rank, engine.world_size, engine.platform,
        collect=lambda: shard_state(engine.model, engine.optimizer, engine.platform),
        connect=lambda: RingTransport(engine.rank, engine.world_size, timeout_s))
    engine.optimizer.register_step_pre_hook(lambda *_: store.wait_copied())
    return store


def restore_engine(engine: Any, copy: ShardCopy) -> None:
    """A rank rebuilt from its buddy's copy: the shard into the engine, its version set."""
    if copy.rank != engine.rank:
        raise EddyError(f"rank {engine.rank} cannot take rank {copy.rank}'s copy: each rank's "
                        "shard is a different slice of the state")
    load_shard(engine.model, engine.optimizer, engine.platform, copy)
    if engine.offload_kind == "optimizer":  # its moments live on the host between steps
        from .offload import HOST, move_optimizer_state

        move_optimizer_state(engine.optimizer, HOST)
        engine.platform.synchronize()
    engine.version = copy.version

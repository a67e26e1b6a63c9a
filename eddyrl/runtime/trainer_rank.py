"""A trainer rank: one data-parallel rank of the trainer, around a training engine (and the KL
reference's). A plain class; `runtime/ray/runtime.py` makes it a Ray actor, `runtime/local.py`
runs it in the driver's process. Rebuilding after a lost rank is its mixin's
(rank_rebuild.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Iterator

import torch

from ..protocol import TrainBatch
from ..core.update import PolicyUpdate, ReplicaShare, logit_temperature
from ..engines.registry import LOW_RANK_RECEIVERS, load_engine_class
from ..hal import WeightBucketSpec, WeightChannel, get_platform, open_weight_channel
from ..hal.rendezvous import TcpStoreServer, make_store
from .devices import bind_actor_device
from .node import node_address
from .node_files import DirectoryShipment, collect_directory
from .rank_rebuild import RankRebuild
from .workers import device_binding, local_model_dir, prepare_process

if TYPE_CHECKING:
    from .settings import TrainerSettings


class TrainerRank(RankRebuild):
    """One data-parallel rank of the trainer. Made in two steps, so that a group spanning
    nodes can form: the constructor prepares the process; `start(rendezvous)` joins the
    trainer group and builds the engines. The rendezvous is a `file://` path where every rank
    is on one machine, or the `tcp://` URL rank 0 serves on its node (`open_rendezvous`),
    passed to every rank by the runtime (hal/rendezvous.py). Given `init_method`, the
    constructor starts at once (one process, tests). After a lost rank, the survivors and a
    replacement form a new group (`rejoin`, rank_rebuild.py)."""

    def __init__(self, settings: TrainerSettings, rank: int, world: int, init_method: str | None,
                 model: str | DirectoryShipment) -> None:
        prepare_process(settings.cluster)
        self.settings = settings
        self.rank, self.world = rank, world
        self.platform = get_platform(settings.platforms.train)
        self.device = bind_actor_device(self.platform, f"trainer rank {rank}")
        self.model_path = local_model_dir(model)
        self.rollout_platform = get_platform(settings.platforms.rollout,
                                             require_available=False)
        self._servers: dict[str, TcpStoreServer] = {}  # tcp rendezvous rank 0 serves
        self._channel_rendezvous: str | None = None  # the weight channel's
        self.channel: WeightChannel | None = None
        self._outgoing: list[dict[str, torch.Tensor]] = []  # buckets awaiting send_weights
        if init_method is not None:
            self.start(init_method)

    def open_rendezvous(self, world_size: int) -> str:
        """Rank 0 of a group spanning nodes: serve its store on this node's cluster address;
        returns the `tcp://` URL every member joins with."""
        address = node_address()
        if address is None:
            raise RuntimeError("a tcp rendezvous needs the node's cluster address; this "
                               "process is not part of a Ray cluster")
        server = TcpStoreServer(address, world_size, self.settings.cluster.timeout_s)
        self._servers[server.url] = server
        return server.url

    def _store(self, rendezvous: str, rank: int, world_size: int):
        """This member's store for a `tcp://` rendezvous (None for `file://`: the group
        makes its own)."""
        if not rendezvous.startswith("tcp://"):
            return None
        if rank == 0:
            return self._servers[rendezvous].store
        return make_store(rendezvous, rank, world_size, self.settings.cluster.timeout_s)

    def start(self, rendezvous: str, snapshot: bool = True) -> None:
        """Join the trainer group at `rendezvous` and build the training engine (and the KL
        reference); with `snapshot`, the first buddy copies (of the initial state)."""
        settings, rank, world = self.settings, self.rank, self.world
        train, cluster = settings.train, settings.cluster
        temperature = logit_temperature(settings.sampling_temperature)
        engine_cls = load_engine_class("train", train.engine)
        store = self._store(rendezvous, rank, world)
        # The group's own timeout: a collective that waits longer for a rank raises here, and
        # the driver reports that rank lost (runtime/ray/trainer_calls.py)
        timeout_s = train.collective_timeout_s
        if store is not None:  # the engine finds the group joined, and leaves it be
            self.platform.init_process_group(rank, world, None, timeout_s,
                                             store=store, address=node_address())

        def build(**optimizer):
            return engine_cls(self.model_path, self.platform, rank=rank, world_size=world,
                              init_method=rendezvous, seed=settings.seed,
                              temperature=temperature, local=cluster.address is None,
                              timeout_s=timeout_s, **train.engine_options(),
                              **optimizer)

        self.engine = build(lr=train.lr, weight_decay=train.weight_decay,
                            grad_clip=train.grad_clip)
        self.update = PolicyUpdate(settings.algorithm, mini_batches=train.mini_batches_per_call)
        # The KL reference is the initial policy: the same engine, sharded the same way, never
        # stepped (AdamW allocates its state lazily, so the unused optimizer costs nothing).
        self.reference = build() if self.update.needs_reference else None
        self._group_rendezvous = rendezvous
        if snapshot:
            self.engine.snapshot()

    def train(self, batch: TrainBatch, replica_results: list | None = None,
              replica_tokens: int = 0) -> dict[str, float]:
        """The RL update on this rank's rows: `mini_batches` optimizer steps, plus how far the
        trainer's log-probs are from the sampler's on the same tokens (before the update).
        `replica_results`: Ray references to joined replicas' (gradients, metric sums) for this
        step, awaited only after this rank's own backward passes (elastic pool)."""
        replicas = _replica_gradients(replica_results) if replica_results else None
        with self.platform.profile_range("eddy.train.step"):
            metrics = self.update(batch, self.engine, self.reference, replicas=replicas,
                                  replica_tokens=replica_tokens)
        self.engine.snapshot()  # the buddy's copy, of this step's end (rank_rebuild.py)
        # what each weight sync sends, and its share of the whole model's bytes (LoRA: the
        # adapter's factors to an engine that merges them, docs/engines.md)
        sent = self.engine.export_bytes(low_rank=self._low_rank_sync)
        return {**metrics, "sync_bytes": float(sent),
                "sync_fraction": sent / self.engine.full_sync_bytes,
                "trainer_version": float(self.engine.version),
                **self.engine.replication_metrics()}

    @property
    def _low_rank_sync(self) -> bool:
        return self.settings.rollout_engine in LOW_RANK_RECEIVERS

    def weight_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """The engine's weight export in the form this run's rollout engine takes."""
        return self.engine.export_weights(self.settings.train.bucket_mb << 20,
                                          low_rank=self._low_rank_sync)

    def connect_weight_channel(self, kind: str, rendezvous: str, rank: int, world: int) -> None:
        if self.rank == 0:
            if self.channel is not None:  # a rebuilt group (a lost worker was replaced)
                self.channel.close()
            # The previous channel's store goes with it. A group's store stays up for as long
            # as the group lives: NCCL / HCCL communicators form lazily, at the first
            # collective, through it.
            if self._channel_rendezvous in self._servers:
                self._servers.pop(self._channel_rendezvous).close()
            self._channel_rendezvous = rendezvous
            store = self._store(rendezvous, rank, world)
            self.channel = open_weight_channel(self.platform, self.rollout_platform, rank=rank,
                                               world_size=world, rendezvous=rendezvous,
                                               kind=kind, timeout_s=self.settings.cluster.timeout_s,
                                               store=store, address=node_address())

    def describe_weights(self) -> list[WeightBucketSpec]:
        """Host channels: the buckets themselves (rank 0); collective: after `send_weights`."""
        with self.platform.profile_range("eddy.weights.export"):
            buckets = list(self.weight_buckets())  # collective on all ranks
        if self.rank != 0 or self.channel is None:
            return []
        self._outgoing = buckets
        return [self.channel.describe(bucket) for bucket in buckets]

    def send_weights(self) -> None:
        """The sending half of a collective transfer (a no-op for host channels)."""
        if self.rank == 0 and self.channel is not None:
            with self.platform.profile_range("eddy.weights.send"):
                for bucket in self._outgoing:
                    self.channel.send(bucket)
        self._outgoing = []

    def save(self, path: str) -> None:
        self.engine.save(path)

    # ---- checkpoints on a cluster without a shared run directory ---------------------------
    def save_on_node(self, name: str) -> str:
        """Save into `name` under this node's temporary directory (each rank writes its own
        files there); returns the path. The driver collects the nodes' files after."""
        path = os.path.join(tempfile.gettempdir(), "eddy-checkpoints", name)
        self.engine.save(path, node_local=True)
        return path

    def node_address(self) -> str | None:
        return node_address()

    def device_binding(self) -> dict[str, object]:
        return device_binding(self.device)

    def whereabouts(self) -> dict[str, object]:
        """Where this rank runs, for the report of its loss: its node's address and Ray id,
        and its process."""
        import ray

        return {"node": node_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    def collect(self, path: str) -> DirectoryShipment:
        """What this node holds of a `save_on_node`, as data for the driver."""
        return collect_directory(path)

    def discard(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def load(self, checkpoint: str | DirectoryShipment) -> None:
        """Load a checkpoint: a path every rank sees, or the driver's files shipped here (read
        from a private copy on this node, removed after)."""
        if not isinstance(checkpoint, DirectoryShipment):
            self.engine.load(checkpoint)
        else:
            local = tempfile.mkdtemp(prefix="eddy-resume-")
            try:
                self.engine.load(checkpoint.materialize(into=local))
            finally:
                shutil.rmtree(local, ignore_errors=True)
        self.engine.snapshot()  # the buddy copies hold the loaded state from now

    # ---- colocated placement: the device is the rollout engine's between training steps -----
    def offload(self) -> None:
        with self.platform.profile_range("eddy.train.offload"):
            for engine in filter(None, (self.engine, self.reference)):
                engine.offload()

    def onload(self) -> None:
        with self.platform.profile_range("eddy.train.onload"):
            for engine in filter(None, (self.engine, self.reference)):
                engine.onload()

    def version(self) -> int:
        return self.engine.version


def _replica_gradients(refs: list) -> ReplicaShare:
    """The joined replicas' part of the step (`PolicyUpdate`'s `replicas`): fetch their
    results from Ray, sum their gradients, and report how many replicas contributed."""
    def fetch() -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        import ray

        total: dict[str, torch.Tensor] = {}
        replica_loss = 0.0
        for grads, sums in ray.get(list(refs)):
            replica_loss += sums["loss"]
            for name, grad in grads.items():
                total[name] = grad if name not in total else total[name] + grad
        # replica_loss: their share of the step's token-mean loss
        return total, {"replicas_joined": float(len(refs)), "replica_loss": replica_loss}
    return fetch

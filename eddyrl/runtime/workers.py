"""The processes of a run: a rollout worker wraps an inference engine, a trainer rank wraps a
training engine. Both are plain classes; `runtime/ray/runtime.py` turns them into Ray actors."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, AsyncIterator, Iterator

import torch

from .. import fault_points
from ..protocol import GenerationRequest, GenerationResult, TrainBatch
from ..core.update import PolicyUpdate, ReplicaShare, logit_temperature
from ..engines.registry import LOW_RANK_RECEIVERS, load_engine_class
from ..engines.training.replica import GradientReplica
from ..hal import WeightBucketSpec, WeightChannel, get_platform, open_weight_channel
from ..hal.rendezvous import TcpStoreServer, make_store
from ..scheduler.buckets import worker_batch_size
from .devices import bind_actor_device
from .node import node_address
from .node_files import DirectoryShipment, collect_directory
from .rank_rebuild import RankRebuild

if TYPE_CHECKING:
    from .config import ClusterConfig
    from .settings import RolloutWorkerSettings, TrainerSettings


def local_model_dir(model: str | DirectoryShipment) -> str:
    """The model's directory on this node: the path itself on one machine or a shared
    filesystem, else this node's copy of the driver's (written once per node)."""
    return model.materialize() if isinstance(model, DirectoryShipment) else model


def _prepare_process(cluster: ClusterConfig) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load bars from every worker drown the run's output
    torch.set_num_threads(cluster.threads_per_worker or os.cpu_count() or 1)


class RolloutWorker:
    """Generates with an inference engine; lent to training by the elastic pool, it also holds
    a gradient replica (`join_training`) and its engine sleeps until `leave_training`."""

    def __init__(self, settings: RolloutWorkerSettings, index: int,
                 model: str | DirectoryShipment,
                 device: int | None = None) -> None:
        """`device`: the device index of the trainer rank this worker is colocated with
        (they take turns on it); None to take a free one (`runtime/devices.py`)."""
        _prepare_process(settings.cluster)
        self.settings = settings
        self.index = index
        self.platform = get_platform(settings.platforms.rollout)
        self.device = bind_actor_device(self.platform, f"rollout worker {index}", shared=device)
        self.model_path = model_path = local_model_dir(model)
        self.replica: GradientReplica | None = None
        self.train_platform = get_platform(settings.platforms.train,
                                           require_available=False)
        os.environ.update(self.platform.inference_engine_env())
        engine_cls = load_engine_class("rollout", settings.engine)
        self.engine = engine_cls(model_path, self.platform, seed=settings.seed * 1000 + index,
                                 max_batch_size=worker_batch_size(
                                     settings.routing, index, settings.max_batch_size),
                                 partial_rollout=settings.partial_rollout,
                                 **settings.engine_options)
        self.channel: WeightChannel | None = None
        self.engine_receives = False  # the engine takes the weights off the broadcast itself

    async def generate(self, requests: list[GenerationRequest]
                       ) -> AsyncIterator[list[GenerationResult]]:
        """Results as soon as their trajectories finish (a Ray streaming generator), grouped by
        what is ready at once (e.g. everything that finished at one decode step): one object per
        group of finishers, not per trajectory, keeps Ray's per-object cost off the hot path."""
        ready: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for result in self.engine.generate(requests):
                    ready.put_nowait(result)
            finally:
                ready.put_nowait(done)

        task = asyncio.ensure_future(pump())
        # the call's whole span (a vendor profiler's range may span the yields between)
        with self.platform.profile_range("eddy.rollout.generate"):
            finished = False
            while not finished:
                batch = [await ready.get()]
                while not ready.empty():
                    batch.append(ready.get_nowait())
                finished = batch[-1] is done
                results = [r for r in batch if r is not done]
                if results:
                    yield results
        await task  # re-raises an engine error

    async def abort(self, request_ids: list[str]) -> None:
        await self.engine.abort(request_ids)

    def weight_ranks(self, kind: str) -> int:
        """Ranks this worker takes in the trainer's weight broadcast group (`kind`, as the
        driver resolved it: `placement.weight_channel_kind`; "collective", or one rank for the
        host channels, which have no group): its engine's own processes where the engine
        receives weights itself, else this process."""
        return self._engine_ranks(kind) or 1

    def _engine_ranks(self, kind: str) -> int:
        """The engine receives itself only from a device broadcast, and not where the elastic
        pool may lend this worker to training: its replica needs the weights here."""
        if kind != "collective" or self.settings.lent_to_training:
            return 0
        return self.engine.weight_ranks()

    def connect_weight_channel(self, kind: str, rendezvous: str, rank: int, world: int) -> None:
        """Join the weight channel as `rank` (the first of `weight_ranks(kind)` ranks)."""
        timeout_s = self.settings.cluster.timeout_s
        if self.channel is not None:  # a rebuilt group (a lost worker was replaced)
            self.channel.close()
            self.channel = None
        if self._engine_ranks(kind):
            self.engine.connect_weight_channel(rendezvous, rank, world, timeout_s,
                                               address=node_address())
            self.engine_receives = True
            return
        self.channel = open_weight_channel(self.train_platform, self.platform, rank=rank,
                                           world_size=world, rendezvous=rendezvous, kind=kind,
                                           timeout_s=timeout_s, address=node_address())

    async def load_weights(self, version: int, specs: list[WeightBucketSpec],
                           hold: bool = False) -> int:
        """Receive each bucket through the channel and load it (`hold`: staged even if idle,
        see `InferenceEngine.load_weights`); returns the version the engine now hosts. Lent to
        training, the worker loads the replica instead (its engine sleeps): the weight sync
        every rollout worker receives doubles as the replica's state fetch."""
        with self.platform.profile_range("eddy.weights.receive"):
            return await self._receive_weights(version, specs, hold)

    async def _receive_weights(self, version: int, specs: list[WeightBucketSpec],
                               hold: bool) -> int:
        if self.engine_receives:  # the engine's processes are ranks of the broadcast
            await self.engine.receive_weights(version, specs, hold=hold)
            return self.engine.version
        assert self.channel is not None, "connect_weight_channel was not called"
        buckets = (self.channel.receive(s) for s in specs)
        if self.replica is None:
            await self.engine.load_weights(version, buckets, hold=hold)
        else:
            weights: dict[str, torch.Tensor] = {}
            for bucket in buckets:
                weights.update(bucket)
            await asyncio.to_thread(self.replica.load_weights, version, weights)
        return self.engine.version

    # ---- elastic pool: lent to training ----------------------------------------------------
    async def join_training(self) -> None:
        """Sleep the engine (its device memory goes to the replica) and build the replica; it
        gets the trainer's weights with the next weight sync (`replica_version` then says
        which)."""
        await self.engine.wait_idle()  # evacuated requests leave at the engine's next step
        await self.engine.sleep()
        self.replica = await asyncio.to_thread(
            GradientReplica, self.model_path, self.platform,
            temperature=logit_temperature(self.settings.sampling_temperature),
            **self.settings.train.forward_options())

    def replica_version(self) -> int:
        return -1 if self.replica is None else self.replica.version

    def replica_gradients(self, batch: TrainBatch, total_tokens: int
                          ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """This share's gradients, normalised over the whole step's `total_tokens`."""
        assert self.replica is not None and self.replica.version >= 0, "not a ready replica"
        fault_points.reached("replica_step", self.index, self.replica.version)  # a test's fault
        # the trainer ranks' update, on this share
        update = PolicyUpdate(self.settings.algorithm)
        return update.replica_gradients(batch, self.replica, total_tokens)

    async def leave_training(self) -> int:
        """Back to rollout: wake the engine and load the replica's weights (the latest it
        received) into it; returns the version the engine now hosts."""
        replica, self.replica = self.replica, None
        await self.engine.wake()
        if replica is not None and replica.version > self.engine.version:
            state = {k: v.detach().clone() for k, v in replica.model.state_dict().items()}
            await self.engine.load_weights(replica.version, [state])
        return self.engine.version

    async def held_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Called with `num_returns=2`: the version, for the driver, and the weights, left in
        the object store for the rebuilt trainer's rank 0 (`InferenceEngine.held_weights`)."""
        return await self.engine.held_weights()

    def stats(self):
        return self.engine.stats()

    def node_address(self) -> str | None:
        return node_address()

    def device_binding(self) -> dict[str, object]:
        return _binding(self.device)

    def configure(self, max_batch_size: int, partial_rollout: bool) -> int:
        """The adaptive scheduler's generation plan; returns the version the engine hosts."""
        self.engine.configure(max_batch_size=max_batch_size, partial_rollout=partial_rollout)
        return self.engine.version

    async def sleep(self) -> None:
        """Colocated hand-over: the engine finishes what it runs, then frees the device."""
        await self.engine.wait_idle()
        await self.engine.sleep()

    async def wake(self) -> None:
        await self.engine.wake()


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
        _prepare_process(settings.cluster)
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
        return _binding(self.device)

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


def _binding(device) -> dict[str, object]:
    """An actor's device and the process that holds it (placement.json: which process to
    look at, or a fault test's to kill)."""
    return {**device.as_dict(), "pid": os.getpid()}


def weight_group_layout(ranks: list[int]) -> tuple[list[int], int]:
    """The weight broadcast group: the trainer is rank 0 (it sends); rollout worker i takes
    `ranks[i]` ranks (`RolloutWorker.weight_ranks`) from its offset on. Returns (offsets,
    world size)."""
    if any(r < 1 for r in ranks):
        raise ValueError(f"every rollout worker takes at least one rank, got {ranks}")
    offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
    return offsets, 1 + sum(ranks)


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

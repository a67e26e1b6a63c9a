"""A rollout worker: generates with an inference engine; lent to training by the elastic pool,
it also holds a gradient replica. A plain class; `runtime/ray/runtime.py` makes it a Ray actor,
`runtime/local.py` runs it in the driver's process."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, AsyncIterator

import torch

from .. import fault_points
from ..protocol import GenerationRequest, GenerationResult, TrainBatch
from ..core.update import PolicyUpdate, logit_temperature
from ..engines.registry import load_engine_class
from ..engines.training.replica import GradientReplica
from ..hal import WeightBucketSpec, WeightChannel, get_platform, open_weight_channel
from ..scheduler.buckets import worker_batch_size
from .devices import bind_actor_device
from .node import node_address
from .node_files import DirectoryShipment
from .workers import device_binding, local_model_dir, prepare_process

if TYPE_CHECKING:
    from .settings import RolloutWorkerSettings


class RolloutWorker:
    """Generates with an inference engine; lent to training by the elastic pool, it also holds
    a gradient replica (`join_training`) and its engine sleeps until `leave_training`."""

    def __init__(self, settings: RolloutWorkerSettings, index: int,
                 model: str | DirectoryShipment,
                 device: int | None = None) -> None:
        """`device`: the device index of the trainer rank this worker is colocated with
        (they take turns on it); None to take a free one (`runtime/devices.py`)."""
        prepare_process(settings.cluster)
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
        return device_binding(self.device)

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

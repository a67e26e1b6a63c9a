"""Workers as Ray actors. With no `cluster.address`, Ray starts on this machine bound to
loopback (token authentication stays on); with an address, Eddy joins that cluster.

`RayRuntime` is what the controller drives: it never sees Ray, only awaitable calls, the
runtime's clock, and the weight sync as one operation.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from typing import Any, AsyncIterator

from ..config import EddyConfig
from ..core.batch import TrainBatch
from ..core.batching import split_for_ranks
from ..engines.inference.base import GenerationRequest, GenerationResult
from ..errors import EddyError
from ..hal import get_platform
from .placement import role_platform_name
from .workers import RolloutWorker, TrainerRank


class WorkerCallError(EddyError, RuntimeError):
    """A worker failed or did not answer in time; the message says which and doing what."""


def start_ray(config: EddyConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    if config.cluster.address is None:
        # Ray binds its local servers to 127.0.0.1 with this set (it otherwise listens on the
        # machine's address); our servers never face the network in local mode.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray.init(num_cpus=config.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                 _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=True,
                 configure_logging=True)
    else:
        ray.init(address=config.cluster.address, logging_level="WARNING")


def _actor_options(platform_name: str, cpus: float) -> dict[str, Any]:
    platform = get_platform(platform_name, require_available=False)
    return {"num_cpus": cpus, **platform.ray_actor_resources(1.0)}


class RayRuntime:
    def __init__(self, config: EddyConfig, model_path: str, work_dir: str) -> None:
        import ray

        start_ray(config)
        self.config = config
        self.timeout_s = config.cluster.timeout_s
        # Fractional CPUs: on a 2-core laptop all workers must fit at once (they take turns).
        cpus = min(1.0, (config.cluster.num_cpus or os.cpu_count() or 2) /
                   (config.rollout.num_workers + config.train.num_workers + 1))
        train_platform = role_platform_name(config, "train")
        rollout_platform = role_platform_name(config, "rollout")
        world = config.train.num_workers
        # File-based rendezvous: one machine's groups need no listening socket at all.
        self.rendezvous_dir = tempfile.mkdtemp(prefix="rendezvous-",
                                               dir=os.path.abspath(work_dir))
        init_method = f"file://{self.rendezvous_dir}/trainer_group"
        trainer_cls = ray.remote(TrainerRank)
        self.trainers = [trainer_cls.options(**_actor_options(train_platform, cpus),
                                             name=None).remote(config, rank, world, init_method,
                                                               model_path)
                         for rank in range(world)]
        worker_cls = ray.remote(RolloutWorker)
        self.workers = [worker_cls.options(**_actor_options(rollout_platform, cpus))
                        .remote(config, index, model_path)
                        for index in range(config.rollout.num_workers)]
        self._connect_weight_channel()

    # ---- calls with names and deadlines ----------------------------------------------------
    async def _call(self, who: str, what: str, ref: Any) -> Any:
        import ray

        try:
            return await asyncio.wait_for(ref, self.timeout_s)
        except asyncio.TimeoutError:
            raise WorkerCallError(f"{who} did not finish {what} within {self.timeout_s:.0f} s "
                                  "(cluster.timeout_s)") from None
        except ray.exceptions.RayError as exc:
            raise WorkerCallError(f"{who} failed during {what}: {exc}") from exc

    async def _all(self, calls: list[tuple[str, str, Any]]) -> list[Any]:
        return await asyncio.gather(*(self._call(*c) for c in calls))

    def _connect_weight_channel(self) -> None:
        import ray

        kind = self.config.train.weight_channel
        world = 1 + len(self.workers)  # trainer rank 0 sends, every rollout worker receives
        rendezvous = f"file://{self.rendezvous_dir}/weight_channel"
        refs = [t.connect_weight_channel.remote(kind, rendezvous, 0, world) for t in self.trainers]
        refs += [w.connect_weight_channel.remote(kind, rendezvous, 1 + i, world)
                 for i, w in enumerate(self.workers)]
        ray.get(refs, timeout=self.timeout_s)

    # ---- what the controller uses ----------------------------------------------------------
    def now(self) -> float:
        return time.monotonic()

    async def generate(self, worker: int, requests: list[GenerationRequest]
                       ) -> AsyncIterator[GenerationResult]:
        """The worker's results one by one as its trajectories finish; the deadline applies to
        each wait for the next result."""
        stream = self.workers[worker].generate.options(num_returns="streaming").remote(requests)
        what = f"generate ({len(requests)} requests)"
        while True:
            try:
                ref = await self._call(f"rollout worker {worker}", what, stream.__anext__())
            except StopAsyncIteration:
                return
            for result in await self._call(f"rollout worker {worker}", what, ref):
                yield result

    async def train(self, batch: TrainBatch, replicas: list[int] | None = None
                    ) -> dict[str, float]:
        """One RL step over the trainer ranks and, from the elastic pool, the rollout workers
        in `replicas` (joined and active): rows are split by tokens over all of them; each
        replica's gradients reach the ranks through the object store (no new communicator)."""
        replicas = list(replicas or [])
        parts = split_for_ranks(batch, len(self.trainers) + len(replicas))
        total = int(batch.loss_mask.sum())
        refs = [self.workers[w].replica_gradients.remote(part, total)
                for w, part in zip(replicas, parts[len(self.trainers):])]
        replica_tokens = int(sum(p.loss_mask.sum() for p in parts[len(self.trainers):]))
        # Nested in a list, the references are not awaited before the ranks start: each rank
        # runs its own forward/backward first and fetches the replicas' gradients after.
        # The driver does not fetch the gradients itself: a replica's failure or hang reaches it
        # through the ranks' calls (and their deadline), which wait for them.
        results = await self._all([(f"trainer rank {r}", "train_step (with replicas "
                                    f"{replicas})" if replicas else "train_step",
                                    t.train.remote(part, refs or None, replica_tokens))
                                   for r, (t, part) in enumerate(zip(self.trainers, parts))])
        return _combine_rank_metrics(results)

    async def configure_rollout(self, max_batch_size: int, partial_rollout: bool) -> list[int]:
        """A new generation plan on every rollout worker; returns the versions they host."""
        return await self._all([(f"rollout worker {i}", "configure",
                                 w.configure.remote(max_batch_size, partial_rollout))
                                for i, w in enumerate(self.workers)])

    async def join_training(self, worker: int) -> None:
        await self._call(f"rollout worker {worker}", "join training",
                         self.workers[worker].join_training.remote())

    async def replica_version(self, worker: int) -> int:
        return await self._call(f"rollout worker {worker}", "replica version",
                                self.workers[worker].replica_version.remote())

    async def leave_training(self, worker: int) -> int:
        return await self._call(f"rollout worker {worker}", "leave training",
                                self.workers[worker].leave_training.remote())

    async def abort(self, worker: int, request_ids: list[str]) -> None:
        await self._call(f"rollout worker {worker}", f"abort ({len(request_ids)} requests)",
                         self.workers[worker].abort.remote(request_ids))

    async def sync_weights(self, version: int) -> list[int]:
        """Trainer -> every rollout worker, through the channel opened at start-up; returns
        the version each worker now hosts (a busy one keeps its own, the new one staged)."""
        specs = await self._all([(f"trainer rank {r}", "weight export", t.describe_weights.remote())
                                 for r, t in enumerate(self.trainers)])
        results = await self._all(
            [(f"trainer rank {r}", "weight send", t.send_weights.remote())
             for r, t in enumerate(self.trainers)]
            + [(f"rollout worker {i}", f"weight load v{version}",
                w.load_weights.remote(version, specs[0])) for i, w in enumerate(self.workers)])
        return list(results[len(self.trainers):])

    async def save(self, path: str) -> None:
        await self._all([(f"trainer rank {r}", f"save to {path}", t.save.remote(path))
                         for r, t in enumerate(self.trainers)])

    async def worker_stats(self) -> list[Any]:
        return await self._all([(f"rollout worker {i}", "stats", w.stats.remote())
                                for i, w in enumerate(self.workers)])

    def shutdown(self) -> None:
        import ray

        for actor in self.trainers + self.workers:
            ray.kill(actor)
        if self.config.cluster.address is None:
            ray.shutdown()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)


def _combine_rank_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Sums for counts, maxima for maxima, rank 0's value for the rest (already all-reduced)."""
    combined = dict(results[0])
    for key in combined:
        values = [r.get(key, 0.0) for r in results]
        if key.endswith("_max"):
            combined[key] = max(values)
        elif key.endswith(("_sum", "_tokens")):
            combined[key] = sum(values)
    return combined

"""One machine, one process: the same controller drives rollout engines and one trainer rank
that live in this process (`cluster.runtime: local`), with no Ray.

What it saves, measured against Ray on the 2-core machine (bench/results/README.md): Ray's
start-up and the actors' own processes (each loads torch, transformers and the model), and per
step the object store's round trips (the batch to the trainer, weights to the engines,
results back). What it cannot do: anything that needs another process: more than one trainer
rank, the elastic pool, replacing a lost worker (a crash here is the run's), colocated
turn-taking. `eddyrl.build` refuses those settings by name (the capability protocols).

The trainer's calls run in a worker thread (`asyncio.to_thread`), so the event loop goes on
streaming results while it trains: with K > 0 generation and training overlap as they do on
Ray (PyTorch releases the GIL in its kernels). The weights go to the engines as copies taken
on the trainer's thread, so the next update never writes into weights an engine reads.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ConfigError
from ..protocol import TrainBatch
from .inprocess import InProcessRuntime

if TYPE_CHECKING:
    from .settings import RuntimeSettings


class LocalRuntime(InProcessRuntime):
    """`Runtime` + `Checkpointable` + `Plannable`, all in this process."""

    def __init__(self, settings: RuntimeSettings, model_path: str, work_dir: str) -> None:
        from .rollout_worker import RolloutWorker
        from .trainer_rank import TrainerRank

        # settings it cannot run (more ranks, colocation, the elastic pool) are refused when
        # the config is loaded (config/schema.py)
        self.rendezvous_dir = tempfile.mkdtemp(prefix="rendezvous-", dir=os.path.abspath(work_dir))
        try:
            self.trainer = TrainerRank(settings.trainer, 0, 1,
                                       f"file://{self.rendezvous_dir}/trainer_group", model_path)
            self.rollout = [RolloutWorker(settings.rollout, index, model_path)
                            for index in range(settings.rollout_workers)]
        except BaseException:  # a failed start, or a stop while loading: no rendezvous left
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
            raise
        super().__init__([worker.engine for worker in self.rollout])

    async def train(self, batch: TrainBatch, replicas: Sequence[int] = ()) -> dict[str, float]:
        if replicas:  # the elastic pool is refused at build time for this runtime
            raise ConfigError("cluster.runtime = local has no elastic pool")
        return await asyncio.to_thread(self.trainer.train, batch)

    async def sync_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        def export() -> list[dict[str, Any]]:
            return [{name: tensor.detach().clone() for name, tensor in bucket.items()}
                    for bucket in self.trainer.weight_buckets()]

        buckets = await asyncio.to_thread(export)
        for index, engine in enumerate(self.workers):
            await engine.load_weights(version, buckets, hold=index in hold)
        return [engine.version for engine in self.workers]

    async def configure_rollout(self, max_batch_size: int, partial_rollout: bool) -> list[int]:
        return [worker.configure(max_batch_size, partial_rollout) for worker in self.rollout]

    async def save(self, path: str) -> None:
        await asyncio.to_thread(self.trainer.save, path)

    async def load(self, path: str) -> None:
        await asyncio.to_thread(self.trainer.load, path)

    def shutdown(self) -> None:
        close = getattr(self.trainer.engine, "close", None)
        if close is not None:
            close()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)

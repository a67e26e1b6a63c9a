"""The two processes of a collective weight transfer, as the runtime runs them on one machine:
rank 0 is a trainer (one-rank FSDP group of its own), rank 1 a rollout worker; they share a
standalone group on the device backend. The test ships the bucket specs through a file, as the
runtime ships them through Ray."""

from __future__ import annotations

import asyncio
import os
import pickle
import time

import torch
from device_helpers import LOSS, greedy, make_trainer
from fsdp_helpers import make_batch

from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.hal import get_platform, open_weight_channel

BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model
TIMEOUT_S = 120.0


def run_rank(rank: int, platform_name: str, model_dir: str, work: str,
             receiver_local_rank: int) -> None:
    os.environ["LOCAL_RANK"] = "0" if rank == 0 else str(receiver_local_rank)
    torch.set_num_threads(1)  # two processes share the host with the test
    platform = get_platform(platform_name)
    if rank == 0:
        _send(platform, model_dir, work)
    else:
        _receive(platform, model_dir, work)


def _connect(platform, work: str, rank: int):
    return open_weight_channel(platform, platform, rank=rank, world_size=2,
                               rendezvous=f"file://{work}/channel", kind="collective",
                               timeout_s=TIMEOUT_S)


def _send(platform, model_dir: str, work: str) -> None:
    trainer = make_trainer(model_dir, platform, f"{work}/trainer_group")
    try:
        trainer.train_step(make_batch(model_dir), LOSS)
        trainer.save(f"{work}/ckpt")  # what a fresh engine is built from, for comparison
        channel = _connect(platform, work, 0)
        buckets = list(trainer.export_weights(BUCKET_BYTES))
        with open(f"{work}/specs.tmp", "wb") as f:
            pickle.dump([channel.describe(bucket) for bucket in buckets], f)
        os.replace(f"{work}/specs.tmp", f"{work}/specs.pkl")
        for bucket in buckets:
            channel.send(bucket)
        platform.synchronize()
        channel.close()
    finally:
        trainer.close()


def _receive(platform, model_dir: str, work: str) -> None:
    sampler = HFInferenceEngine(model_dir, platform, seed=0)
    before = greedy(sampler)
    channel = _connect(platform, work, 1)
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(f"{work}/specs.pkl"):
        if time.monotonic() > deadline:
            raise TimeoutError("the trainer rank never published its bucket specs")
        time.sleep(0.05)
    with open(f"{work}/specs.pkl", "rb") as f:
        specs = pickle.load(f)
    # As RolloutWorker.load_weights: the engine pulls each bucket off the channel in its thread.
    asyncio.run(sampler.load_weights(1, (channel.receive(spec) for spec in specs)))
    channel.close()
    after = greedy(sampler)
    fresh = greedy(HFInferenceEngine(f"{work}/ckpt", platform, seed=0))
    torch.save({"before": before, "after": after, "fresh": fresh, "buckets": len(specs),
                "version": sampler.version}, f"{work}/result.pt")

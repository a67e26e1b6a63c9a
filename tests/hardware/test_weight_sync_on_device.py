"""Trained weights reach an inference engine on the same kind of device, through the channel the
runtime opens between them, and then generate exactly what a fresh engine built from the same
saved weights generates.

Between like platforms the runtime uses `choose_weight_channel`: `collective` between accelerators
(two processes on a device backend), `object_store` on CPUs (host tensors); the host channel is
also what a run forced to `train.weight_channel=object_store` uses. Both are tested, each on the
platform where it can run."""

import asyncio
import time

import pytest
import torch
import torch.multiprocessing as mp
import weight_sync_ranks
from device_helpers import LOSS, greedy, make_trainer
from fsdp_helpers import make_batch

from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.hal import choose_weight_channel, open_weight_channel

pytestmark = pytest.mark.hardware


def _assert_synced(before, after, fresh):
    """Same tokens and log-probs as a fresh engine on the saved weights, and not the old ones."""
    assert after[0] == fresh[0]
    torch.testing.assert_close(torch.tensor(sum(after[1], [])), torch.tensor(sum(fresh[1], [])))
    assert before[1] != after[1], "the load changed nothing: were the trained weights sent?"


def test_weights_reach_the_sampler_through_the_host_channel(accelerator, tiny_model_dir,
                                                            tmp_path, hardware_report):
    trainer = make_trainer(tiny_model_dir, accelerator, str(tmp_path / "pg"))
    try:
        trainer.train_step(make_batch(tiny_model_dir), LOSS)
        trainer.save(str(tmp_path / "ckpt"))
        channel = open_weight_channel(accelerator, accelerator, kind="object_store")
        received = []
        for bucket in trainer.export_weights(weight_sync_ranks.BUCKET_BYTES):
            spec = channel.describe(bucket)  # host tensors, as the runtime hands them over
            channel.send(bucket)
            received.append(channel.receive(spec))
    finally:
        trainer.close()
    assert len(received) > 1
    assert {t.device.type for b in received for t in b.values()} == {accelerator.device_type}
    sampler = HFInferenceEngine(tiny_model_dir, accelerator, seed=0)
    before = greedy(sampler)
    asyncio.run(sampler.load_weights(1, received))
    after = greedy(sampler)
    assert sampler.version == 1
    fresh = greedy(HFInferenceEngine(str(tmp_path / "ckpt"), accelerator, seed=0))
    hardware_report(runtime_channel=choose_weight_channel(accelerator, accelerator),
                    buckets=len(received))
    _assert_synced(before, after, fresh)


def _start_ranks(*args):
    """A fork server imports torch and transformers once and forks both ranks from that clean
    process (no device context in it), faster than two spawns on a small host."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    mp.set_forkserver_preload(["weight_sync_ranks", "transformers.models.qwen3.modeling_qwen3"])
    return mp.start_processes(weight_sync_ranks.run_rank, args=args, nprocs=2, join=False,
                              start_method=method)


def test_weights_reach_the_sampler_through_the_collective_channel(accelerator, tiny_model_dir,
                                                                  tmp_path, hardware_report):
    count = accelerator.device_count()
    if accelerator.device_type != "cpu" and count < 2:
        # NCCL (and HCCL) refuse two ranks of one communicator on one device ("Duplicate GPU
        # detected"); the runtime gives every trainer rank and rollout worker a whole device.
        pytest.skip(f"{accelerator.name}: the collective channel needs 2 devices, has {count}")
    context = _start_ranks(accelerator.name, tiny_model_dir, str(tmp_path), min(1, count - 1))
    deadline = time.monotonic() + 2 * weight_sync_ranks.TIMEOUT_S
    while not context.join(timeout=1.0):  # re-raises a rank's exception
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail("the trainer and rollout ranks were still running at the deadline")
    result = torch.load(tmp_path / "result.pt")
    hardware_report(runtime_channel=choose_weight_channel(accelerator, accelerator),
                    buckets=result["buckets"], receiver_device=min(1, count - 1))
    assert result["version"] == 1 and result["buckets"] > 1
    _assert_synced(result["before"], result["after"], result["fresh"])

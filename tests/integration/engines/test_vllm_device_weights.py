"""Weights taken off the trainer's broadcast by the engine's own processes (vllm_transfer.py;
`RolloutWorker` and `RayRuntime` delegate to it), on the CPU for real: a rollout worker whose
vLLM engine joins a gloo broadcast group (a CPU run forced to `train.weight_channel=collective`:
the code path of NCCL / HCCL, another backend), the trainer's end in a thread of this process;
and the layer-wise reload run on vLLM's CPU worker. Both reuse the session's vLLM engine
(conftest.py). (The pure logic, with fake groups and workers: test_vllm_weight_staging.py;
device to device: test_vllm_device_to_device.py.)
"""

import asyncio
import dataclasses

import pytest
import torch
from vllm_broadcast import (TIMEOUT_S, assert_same_outputs, broadcast_while,
                            check_delayed_while_busy, connect_trainer, greedy_outputs,
                            in_buckets, shifted_weights)
from vllm_marks import needs_vllm

from eddyrl.engines.inference.vllm.weights import pack
from eddyrl.hal import get_platform
from eddyrl.runtime.workers import weight_group_layout


@pytest.fixture()
def vllm(vllm_engine, initial_weights):
    vllm_engine.configure(partial_rollout=False, max_batch_size=256)
    asyncio.run(vllm_engine.load_weights(0, [initial_weights]))
    return vllm_engine


def _rollout_worker(monkeypatch, model_dir, engine=None, *overrides):
    """A RolloutWorker as Ray runs it, minus Ray; around `engine` (the session's vLLM engine)
    instead of a new one, or an `hf` engine. Its process-wide settings are put back after."""
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime import rollout_worker

    config = load_config(overrides=[f"model.path={model_dir}", "platform=cpu",
                                    f"rollout.engine={'vllm' if engine else 'hf'}",
                                    f"cluster.timeout_s={TIMEOUT_S}", *overrides])
    if engine is not None:
        monkeypatch.setattr(rollout_worker, "load_engine_class",
                            lambda role, name: lambda *args, **kwargs: engine)
    for key in get_platform("cpu").inference_engine_env():
        monkeypatch.setenv(key, "")  # recorded, so the worker's values are undone after
    threads = torch.get_num_threads()
    try:
        return rollout_worker.RolloutWorker(runtime_settings(config).rollout, 0, model_dir)
    finally:
        torch.set_num_threads(threads)


def test_an_engine_without_its_own_receiver_leaves_it_to_the_worker(monkeypatch,
                                                                    tiny_model_dir):
    worker = _rollout_worker(monkeypatch, tiny_model_dir)  # hf
    assert worker.engine.weight_ranks() == 0
    assert worker.weight_ranks("collective") == worker.weight_ranks("object_store") == 1
    assert worker._engine_ranks("collective") == 0


@needs_vllm
def test_a_cpu_run_and_a_lendable_worker_keep_the_host_path(monkeypatch, vllm, tiny_model_dir):
    worker = _rollout_worker(monkeypatch, tiny_model_dir, vllm)
    assert vllm.weight_ranks() == 1  # one vLLM worker ("uni" executor)
    # CPU to CPU the channel is the object store: the worker process receives, as before
    assert worker._engine_ranks("object_store") == 0
    assert worker._engine_ranks("host") == 0 and worker.weight_ranks("object_store") == 1
    assert worker._engine_ranks("collective") == 1
    monkeypatch.setattr(worker, "settings",
                        dataclasses.replace(worker.settings, lent_to_training=True))
    assert worker._engine_ranks("collective") == 0  # a replica would need the weights here


@needs_vllm
def test_the_engine_takes_a_collective_channel_s_broadcast_itself(monkeypatch, vllm,
                                                                   tiny_model_dir, tmp_path):
    """Through the RolloutWorker as the runtime drives it: the vLLM worker joins the group
    (gloo here), receives every bucket into its own buffers and loads them; the same weights
    sent through host memory give the same outputs; a wrong update is received whole (the
    trainer is not left waiting), refused, and changes nothing; a busy engine keeps hosting
    its version with the received one staged."""
    worker = _rollout_worker(monkeypatch, tiny_model_dir, vllm)
    offsets, world = weight_group_layout([worker.weight_ranks("collective")])
    rendezvous = f"file://{tmp_path}/weight_channel"
    channel = connect_trainer(get_platform("cpu"), rendezvous, world, lambda: (
        worker.connect_weight_channel("collective", rendezvous, offsets[0], world)))
    assert worker.engine_receives and worker.channel is None
    try:
        buckets = in_buckets(shifted_weights(tiny_model_dir, 7))
        specs = [channel.describe(bucket) for bucket in buckets]
        assert broadcast_while(channel, buckets, lambda: worker.load_weights(6, specs)) == 6
        received = greedy_outputs(vllm)
        assert all(set(r.versions) == {6} for r in received)
        asyncio.run(vllm.load_weights(7, buckets))  # the same weights through host memory
        assert_same_outputs(greedy_outputs(vllm), received)

        bad = [{**buckets[0], "not.a.weight": torch.zeros(2)}] + buckets[1:]
        with pytest.raises(KeyError, match="do not belong"):
            broadcast_while(channel, bad, lambda: worker.load_weights(
                8, [channel.describe(bucket) for bucket in bad]))
        assert vllm.version == 7 and vllm.stats().staged_version is None
        assert_same_outputs(greedy_outputs(vllm), received)

        check_delayed_while_busy(vllm, channel, buckets, specs, hosted=7, new=9)
    finally:
        channel.close()


@needs_vllm
def test_the_layerwise_reload_loads_what_reload_weights_loads(vllm, tiny_model_dir):
    """vllm-ascend 0.23's path (`reload_strategy` "layerwise"), forced on vLLM's CPU worker:
    the outputs match a plain transformers engine holding the same weights."""
    from eddyrl.engines.inference.hf import HFInferenceEngine

    new = shifted_weights(tiny_model_dir, 11)

    async def reload_layerwise():
        await vllm._rpc_all("eddy_begin_staging")
        await vllm._rpc("eddy_stage", pack(new))
        await vllm._rpc_all("eddy_commit_staged")
        await vllm._rpc_all("eddy_apply_staged", "layerwise")
        await vllm._llm.reset_prefix_cache()
    vllm._thread.run(reload_layerwise())
    hf = HFInferenceEngine(tiny_model_dir, get_platform("cpu"))
    asyncio.run(hf.load_weights(0, [new]))
    assert_same_outputs(greedy_outputs(vllm), greedy_outputs(hf))

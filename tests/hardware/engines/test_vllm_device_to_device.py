"""Weights taken off the trainer's broadcast by a vLLM engine, NVIDIA / Ascend: device to
device, the trainer on device 0 and the engine on device 1; skipped without two devices of an
accelerator (a device may appear once in a communicator) and vLLM for it. (The same on the
CPU, through gloo: test_vllm_device_weights.py.)"""

import asyncio

import pytest
from vllm_broadcast import (TIMEOUT_S, assert_same_outputs, broadcast_while,
                            check_delayed_while_busy, connect_trainer, greedy_outputs,
                            in_buckets, shifted_weights)
from vllm_marks import VLLM_INSTALLED

from eddyrl.hal import get_platform, known_platforms


def _accelerators():
    params = []
    for name in known_platforms():
        platform = get_platform(name, require_available=False)
        if platform.device_type == "cpu":
            continue
        reason = platform.unavailable_reason()
        if reason is None and platform.device_count() < 2:
            reason = (f"needs 2 devices (trainer and engine; a device appears once in a "
                      f"communicator), has {platform.device_count()}")
        if reason is None and not VLLM_INSTALLED:
            reason = "vLLM is not installed"
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.hardware
@pytest.mark.parametrize("platform_name", _accelerators())
def test_weights_reach_vllm_device_to_device(platform_name, tiny_model_dir, tmp_path,
                                             monkeypatch):
    """The trainer's end (this process, device 0) broadcasts over NCCL / HCCL into the vLLM
    worker (device 1); the outputs equal those after the same weights came through host
    memory, and a busy engine keeps its version with the received one staged."""
    from eddyrl.engines.inference.vllm.engine import VLLMInferenceEngine

    platform = get_platform(platform_name)
    with monkeypatch.context() as env:  # the engine-core process sees device 1 only
        env.setenv(platform.visible_devices_env, "1")
        engine = VLLMInferenceEngine(tiny_model_dir, platform, seed=0, dtype="bfloat16")
    try:
        rendezvous = f"file://{tmp_path}/weight_channel"
        channel = connect_trainer(platform, rendezvous, 2, lambda: (
            engine.connect_weight_channel(rendezvous, 1, 2, TIMEOUT_S)))
        buckets = in_buckets(shifted_weights(tiny_model_dir, 3))
        specs = [channel.describe(bucket) for bucket in buckets]
        broadcast_while(channel, buckets, lambda: engine.receive_weights(1, specs))
        received = greedy_outputs(engine)
        assert engine.version == 1 and all(set(r.versions) == {1} for r in received)
        asyncio.run(engine.load_weights(2, buckets))  # the same weights through host memory
        assert_same_outputs(greedy_outputs(engine), received, tol=1e-3)

        check_delayed_while_busy(engine, channel, buckets, specs, hosted=2, new=3)
        channel.close()
    finally:
        engine.close()

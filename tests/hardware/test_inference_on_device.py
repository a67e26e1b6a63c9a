"""The `hf` inference engine on the device: generation with left-padded prompts, abort, sleep."""

import asyncio
import math

import pytest
import torch
from device_helpers import collect, requests

from eddyrl.engines.inference.hf import HFInferenceEngine
from eddyrl.platform_checks.engines import check_hf_abort

pytestmark = pytest.mark.hardware


@pytest.fixture
def engine(accelerator, tiny_model_dir):
    return HFInferenceEngine(tiny_model_dir, accelerator, seed=3)


def test_generates_on_the_device_with_finite_logprobs_and_versions(engine, accelerator):
    assert all(p.device.type == accelerator.device_type for p in engine.model.parameters())
    results = collect(engine, requests("r", max_new=12, temperature=1.0))
    assert [r.request_id for r in results] == [f"r{i}" for i in range(4)]
    for r in results:
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions) > 0
        assert set(r.versions) == {0} and r.finish_reason in ("stop", "length")
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.logprobs), r.logprobs
    stats = engine.stats()
    assert stats.running == stats.waiting == 0
    assert stats.tokens_generated == sum(len(r.token_ids) for r in results)


def test_abort_returns_partial_output(accelerator):
    """The shipped check (`eddy platforms check` runs it too): an aborted request comes back at
    once with its partial output, tokens, log-probs and versions in step."""
    check_hf_abort(accelerator)


def test_sleep_frees_device_memory_and_wake_restores_generation(engine, accelerator,
                                                                hardware_report):
    greedy = requests("g", max_new=8, temperature=0.0)
    before = collect(engine, greedy)
    accelerator.synchronize()
    awake = accelerator.memory_info().allocated
    asyncio.run(engine.sleep())
    asleep = accelerator.memory_info().allocated
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    hardware_report(awake_bytes=awake, asleep_bytes=asleep, weight_bytes=weights)
    if accelerator.device_type != "cpu":  # on the CPU the "device" memory is the process's RSS
        assert asleep <= awake - weights // 2
    asyncio.run(engine.wake())
    after = collect(engine, greedy)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    torch.testing.assert_close(torch.tensor(sum((r.logprobs for r in after), [])),
                               torch.tensor(sum((r.logprobs for r in before), [])))

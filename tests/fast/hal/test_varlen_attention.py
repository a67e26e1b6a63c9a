"""`Platform.varlen_attention` and the `varlen_attention` platform check, no model.

Each platform answers without a device (no crash, None where it is absent) and never in fp32,
which no variable-length kernel here runs; CUDA's and Ascend's rules, with the device and the
libraries they ask about stood in for. The check passes with "none" where a platform has no
kernel. (The check run in full on the CPU, with the tiny model: test_varlen_attention_check.py.)
"""

import pytest
import torch

from eddyrl.hal import get_platform, known_platforms
from eddyrl.hal.cpu import CpuPlatform
from eddyrl.platform_checks import CHECKS


@pytest.mark.parametrize("name", ["cpu", "cuda", "npu"])
def test_each_platform_answers_without_a_device_and_never_in_fp32(name):
    assert name in known_platforms()
    platform = get_platform(name, require_available=False)
    assert platform.varlen_attention(torch.float32) is None
    answer = platform.varlen_attention(torch.bfloat16)
    if platform.check_usable() is not None or platform.device_type == "cpu":
        assert answer is None, answer


@pytest.mark.parametrize("capability, installed, imports, dtype, want", [
    ((9, 0), True, True, torch.bfloat16, "flash_attention_2"),
    ((8, 0), True, True, torch.float16, "flash_attention_2"),
    ((9, 0), True, True, torch.float32, None),  # flash-attn runs in half precision only
    ((7, 5), True, True, torch.float16, None),  # flash-attn 2: Ampere and later
    ((9, 0), False, True, torch.bfloat16, None),  # not installed
    ((9, 0), True, False, torch.bfloat16, None),  # installed, but its build does not import
])
def test_cuda_offers_flash_attention_where_it_runs(monkeypatch, capability, installed, imports,
                                                   dtype, want):
    import sys
    import types

    import transformers.utils

    cuda = get_platform("cuda", require_available=False)
    monkeypatch.setattr(type(cuda), "check_usable", lambda self: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: installed)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn")
                        if imports else None)  # None: `import flash_attn` raises ImportError
    assert cuda.varlen_attention(dtype) == want


def test_npu_offers_the_fused_attention_in_half_precision(monkeypatch):
    npu = get_platform("npu", require_available=False)
    monkeypatch.setattr(type(npu), "check_usable", lambda self: None)
    assert npu.varlen_attention(torch.bfloat16) == "flash_attention_2"
    assert npu.varlen_attention(torch.float16) == "flash_attention_2"
    assert npu.varlen_attention(torch.float32) is None


def test_the_check_says_none_where_the_platform_has_no_kernel():
    assert CHECKS["varlen_attention"](CpuPlatform()) == \
        "none at bfloat16: packed training uses the dense block mask"

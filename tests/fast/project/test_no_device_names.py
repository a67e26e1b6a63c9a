"""The rule that makes a new accelerator one file: only eddyrl/hal/ (and vendor engine adapters)
may name a device, a device library or a device-specific variable."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "eddyrl"
ALLOWED = ("hal/", "engines/inference/vllm")  # the HAL, and the adapter wrapping a vendor engine
FORBIDDEN = re.compile(
    r"torch\.cuda|torch\.npu|torch_npu|\bnvtx\b|\bmstx\b|[\"'](nccl|hccl)[\"']|"
    r"CUDA_VISIBLE_DEVICES|ASCEND_RT_VISIBLE_DEVICES|is_npu_available|\.cuda\(\)|\.npu\(\)|"
    r"[\"']cuda(:\d+)?[\"']|[\"']npu(:\d+)?[\"']")


def test_no_device_names_outside_hal():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                offenders.append(f"eddyrl/{rel}:{lineno}: {line.strip()}")
    assert not offenders, "device names outside eddyrl/hal/:\n" + "\n".join(offenders)


def test_the_rule_catches_what_it_should():
    for bad in ('torch.cuda.synchronize()', 'import torch_npu', 'backend="nccl"',
                'os.environ["CUDA_VISIBLE_DEVICES"]', "x.cuda()", 'torch.device("npu:0")'):
        assert FORBIDDEN.search(bad), bad
    for fine in ("platform.synchronize()", "device_type = platform.device_type", "accuracy"):
        assert not FORBIDDEN.search(fine), fine

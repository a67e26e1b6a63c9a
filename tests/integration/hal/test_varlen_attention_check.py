"""The `varlen_attention` platform check run in full on the CPU (it builds the tiny model),
through a platform that declares transformers' sdpa (which keeps packed rows apart by their
positions: tests/integration/engines/test_varlen_packing_on_model.py): it passes such a kernel, and fails
when the attention lets the packed rows see each other. (Each platform's answer, and the check
where a platform has no kernel: test_varlen_attention.py.)"""

import pytest

from eddyrl.hal.cpu import CpuPlatform
from eddyrl.platform_checks import CHECKS


class SdpaVarlenCpu(CpuPlatform):
    def varlen_attention(self, dtype):
        return "sdpa"


@pytest.mark.integration  # the check builds the tiny model
def test_the_check_passes_a_kernel_that_keeps_packed_rows_apart():
    detail = CHECKS["varlen_attention"](SdpaVarlenCpu())
    assert detail.startswith("sdpa in bfloat16: max gap to fp32 "), detail


@pytest.mark.integration  # the check builds the tiny model
def test_the_check_fails_a_kernel_that_lets_packed_rows_see_each_other(monkeypatch):
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(AssertionError, match="does the kernel keep the packed rows apart"):
        CHECKS["varlen_attention"](SdpaVarlenCpu())

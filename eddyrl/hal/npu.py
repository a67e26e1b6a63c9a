"""Huawei Ascend NPUs through `torch_npu` (CANN) and HCCL.

`torch_npu` is imported lazily, never at package import: on a machine without CANN, importing it
fails, and it must not take the other platforms down with it.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
from typing import Any, Iterator

import torch

from .base import Platform


def _import_torch_npu():
    import torch_npu  # noqa: F401  (registers the "npu" device module and the hccl backend)

    return torch_npu


class NpuPlatform(Platform):
    name = "npu"
    device_type = "npu"
    ray_resource = "NPU"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    detect_priority = 90
    description = "Huawei Ascend NPUs (torch_npu, HCCL)"

    def module(self) -> Any:
        _import_torch_npu()
        return torch.npu

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed (pip install 'eddyrl[ascend]' on a CANN machine)"
        try:
            _import_torch_npu()
        except Exception as exc:  # missing CANN libraries surface as ImportError/OSError
            return f"torch_npu failed to import ({type(exc).__name__}: {exc}); is CANN set up?"
        if not torch.npu.is_available():
            return "torch_npu is installed but no NPU is visible (ASCEND_RT_VISIBLE_DEVICES?)"
        return None

    def dist_backend(self) -> str:
        return "hccl"

    def socket_env(self, interface: str, address: str) -> dict[str, str]:
        # HCCL's host-side sockets (rendezvous) follow HCCL_SOCKET_IFNAME; HCCL_IF_IP names
        # the address its initialisation uses.
        return {**super().socket_env(interface, address), "HCCL_SOCKET_IFNAME": interface,
                "HCCL_IF_IP": address}

    def new_standalone_group(self, store: Any, rank: int, world_size: int,
                             timeout_s: float = 600.0) -> Any:
        torch_npu = _import_torch_npu()
        hccl = torch_npu._C._distributed_c10d.ProcessGroupHCCL
        options = hccl.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        return hccl(store, rank, world_size, options)

    def release_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        torch.npu.synchronize()
        torch.npu.empty_cache()

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if dtype == torch.bfloat16:
            return self.is_available() and torch.npu.is_bf16_supported()
        return dtype in (torch.float16, torch.float32)

    def varlen_attention(self, dtype: torch.dtype) -> str | None:
        """The fused attention with actual sequence lengths, in fp16 / bf16: on Ascend,
        transformers runs `flash_attention_2` as `torch_npu.npu_fusion_attention` in the TND
        layout with `actual_seq_qlen` / `actual_seq_kvlen` (each sequence's cumulative end,
        found from `position_ids`) and the compressed causal mask (`sparse_mode` 3, or 2 with
        NPU_FA2_SPARSE_MODE=2: the same for a query as long as its keys)
        (transformers/integrations/npu_flash_attention.py). No flash-attn package needed."""
        if dtype not in (torch.float16, torch.bfloat16) or self.check_usable() is not None:
            return None
        return "flash_attention_2"

    @contextlib.contextmanager
    def profile_range(self, name: str) -> Iterator[None]:
        from torch_npu.npu import mstx

        range_id = mstx.range_start(name)  # host-side marker; errors are logged, not raised
        try:
            yield
        finally:
            mstx.range_end(range_id)

    def apply_model_patches(self, model: torch.nn.Module) -> torch.nn.Module:
        """Route RMSNorm layers through the fused `npu_rms_norm` kernel."""
        torch_npu = _import_torch_npu()

        def fused_forward(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
            return torch_npu.npu_rms_norm(hidden, norm.weight, epsilon=eps)[0]

        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight"):
                module.forward = fused_forward.__get__(module)
        return model

    def ray_node_resources(self) -> dict[str, float]:
        return {}  # Ray counts NPUs itself, and sets ASCEND_RT_VISIBLE_DEVICES per actor

    def inference_engine_env(self) -> dict[str, str]:
        # NZ weight layout breaks in-place weight reloads from the trainer, so RL keeps ND.
        return {"VLLM_ASCEND_ENABLE_NZ": "0", "TASK_QUEUE_ENABLE": "1"}

"""NVIDIA GPUs through `torch.cuda` and NCCL."""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Iterator

import torch

from .base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    ray_resource = "GPU"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    detect_priority = 100
    description = "NVIDIA GPUs (torch.cuda, NCCL)"

    def unavailable_reason(self) -> str | None:
        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA support"
        if not torch.cuda.is_available():
            return "torch has CUDA support but no GPU is visible (driver, CUDA_VISIBLE_DEVICES?)"
        return None

    def dist_backend(self) -> str:
        return "nccl"

    def socket_env(self, interface: str, address: str) -> dict[str, str]:
        return {**super().socket_env(interface, address), "NCCL_SOCKET_IFNAME": interface}

    def collective_error_env(self) -> dict[str, str]:
        """NCCL's watchdog, on a collective that failed or timed out, by default ends the
        process (`TORCH_NCCL_ASYNC_ERROR_HANDLING` 3, SkipCleanUp, in torch's
        ProcessGroupNCCL.hpp `ErrorHandlingMode`): every surviving rank would die with the
        lost one. 2 (CleanUpOnly) aborts the communicators and raises in the rank's thread,
        which then leaves the group (`distributed.abandon`) and joins the new one."""
        return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

    def new_standalone_group(self, store: Any, rank: int, world_size: int,
                             timeout_s: float = 600.0) -> Any:
        import torch.distributed as dist

        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)

    def release_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()  # frees blocks other processes no longer reference

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if dtype == torch.bfloat16:
            return self.is_available() and torch.cuda.is_bf16_supported()
        return dtype in (torch.float16, torch.float32)

    def varlen_attention(self, dtype: torch.dtype) -> str | None:
        """flash-attn 2 where it is installed, on Ampere or later, in fp16 / bf16 (its only
        dtypes): transformers finds each sequence's start in `position_ids` and calls
        `flash_attn_varlen_func` with their cumulative lengths
        (transformers/modeling_flash_attention_utils.py)."""
        from transformers.utils import is_flash_attn_2_available

        if dtype not in (torch.float16, torch.bfloat16) or self.check_usable() is not None:
            return None
        if torch.cuda.get_device_capability(self.local_rank())[0] < 8:  # flash-attn 2: sm80+
            return None
        if not is_flash_attn_2_available():  # not installed, or older than transformers takes
            return None
        try:  # a build for another torch or CUDA fails here, not in the first step
            import flash_attn  # noqa: F401
        except Exception:
            return None
        return "flash_attention_2"

    @contextlib.contextmanager
    def profile_range(self, name: str) -> Iterator[None]:
        # a start/end range, not push/pop: push/pop is a per-thread stack, and ranges of
        # concurrent coroutines (an engine's generate calls) end in any order
        range_id = torch.cuda.nvtx.range_start(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_end(range_id)

    def ray_actor_resources(self, fraction: float = 1.0) -> dict[str, Any]:
        return {"num_gpus": fraction}

    def ray_node_resources(self) -> dict[str, float]:
        return {}  # Ray counts GPUs itself, and sets CUDA_VISIBLE_DEVICES per actor

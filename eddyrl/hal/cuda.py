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

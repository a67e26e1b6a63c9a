"""Plain CPUs: always present; gloo collectives; host memory; the Ray object store for weights."""

from __future__ import annotations

import os
import platform as _platform
import resource

import torch

from .base import DeviceProperties, MemoryInfo, Platform


def _meminfo_bytes(field: str) -> int:
    """One field of /proc/meminfo in bytes, 0 where the file does not exist (macOS)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


class _HostEvent:
    """CPU kernels run synchronously, so an event is complete as soon as it is recorded."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    detect_priority = 0
    description = "host CPUs (gloo collectives)"

    def unavailable_reason(self) -> str | None:
        return None

    def device_count(self) -> int:
        return 1

    def properties(self, index: int = 0) -> DeviceProperties:
        total = _meminfo_bytes("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceProperties(name=f"{_cpu_name()} ({os.cpu_count()} cores)", total_memory=total)

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")  # no index: CPU tensors report plain "cpu"

    def set_device(self, local_rank: int) -> None:
        pass

    def new_event(self, enable_timing: bool = False):
        return _HostEvent()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)  # pinning needs an accelerator

    def copy_to_host_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _HostEvent:
        """The device is the host: plain copies, done when this returns."""
        for source, destination in pairs:
            destination.copy_(source)
        return _HostEvent()

    def device_memory_bytes(self, index: int = 0) -> int:
        """The host's memory available now (MemAvailable), not its total: every process of
        the run and everything else on the machine share it."""
        return _meminfo_bytes("MemAvailable") or self.properties().total_memory

    def memory_info(self) -> MemoryInfo:
        total = self.properties().total_memory
        free = _meminfo_bytes("MemAvailable") or total
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        rss = peak
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        # The two readings are taken at different instants; the peak cannot be below now.
        return MemoryInfo(free=free, total=total, allocated=rss, peak_allocated=max(peak, rss))

    def empty_cache(self) -> None:
        pass  # the host allocator returns memory to the OS by itself

    def reset_peak_memory(self) -> None:
        pass  # ru_maxrss cannot be reset; documented as "peak since process start" on CPU

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state()}

    def varlen_attention(self, dtype: torch.dtype) -> str | None:
        # None: transformers' sdpa and eager do tell packed sequences apart by their
        # position_ids, but by building the [T, T] block mask themselves: nothing saved over
        # the shared-prompt layout's mask, which also shares the prompts' forward pass
        return None

    def inference_engine_env(self) -> dict[str, str]:
        # vLLM's CPU backend runs its one worker in a process of its own unless the first is
        # 0: a process more (~5 s of start-up), and weight buckets sent to the worker by RPC
        # arrive as buffer views that its executor cannot pickle on to that process.
        # The engine's process computes with the threads this worker was given
        # (cluster.threads_per_worker) but one, which the worker's own process needs to take
        # the tokens it streams back: with every core, the engine's spinning threads starve
        # it (measured on 2 cores: ~4,500 tokens/s with 1 thread, ~400 with 2).
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "OMP_NUM_THREADS": str(max(1, torch.get_num_threads() - 1))}

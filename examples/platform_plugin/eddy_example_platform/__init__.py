"""The template a vendor copies to port Eddy to a new accelerator: one `Platform` subclass.

Register the class under the `eddyrl.platforms` entry-point group (pyproject.toml beside this
package); the entry point's name must equal the class's `name`. Then `eddy platforms` lists it,
`eddy platforms check example` runs the contract on it, and every `eddy` command runs on it with
`platform=example` (or `EDDY_PLATFORM=example`). Nothing in Eddy changes.

This template drives the host CPU so that it runs anywhere (CI tests it): where it says
`torch.device("cpu")` or `torch.cpu`, a real device calls its own runtime (`torch.acme`, a
PrivateUse1 backend). It pretends the machine has `EXAMPLE_DEVICE_COUNT` devices (4 by default)
behind one Ray resource, so that the runtime's per-actor device binding shows, and with
`EXAMPLE_PLATFORM_LOG=<file>` it writes one JSON line per hook call (pid, hook, details): what a
vendor profiler would have seen.

What a device must override, because the defaults in `eddyrl/hal/base.py` go through
`torch.get_device_module(device_type)` and `torch.Stream` / `torch.Event`, which work only for a
device type torch knows (`torch.accelerator`): identity (`device_type`, `unavailable_reason`,
`device_count`, `properties`), placement (`device`, `set_device`), execution (`synchronize`,
`new_stream`, `current_stream`, `new_event`), memory (`memory_info`, `empty_cache`,
`reset_peak_memory`), randomness (`get_rng_state` / `set_rng_state` when the device has its own
generator), collectives (`dist_backend` and `new_standalone_group` for the device's collective
library; gloo is the fallback and moves host tensors), and `supports_dtype` (the contract
requires `supports_dtype(torch.float64)` to be False: training and inference run in fp32, bf16
or fp16). Optional, with working defaults: `profile_range` (no-op), `apply_model_patches`
(none), `inference_engine_env` (none), `socket_env` (gloo's variable only), `release_memory` /
`restore_memory`, `weight_channels`, `ray_actor_resources` / `ray_bundle` /
`ray_node_resources` (from `ray_resource`), `bind_device` (from `visible_devices_env`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from typing import Iterator

import torch

from eddyrl.hal.base import DeviceProperties, MemoryInfo, Platform

COUNT_ENV = "EXAMPLE_DEVICE_COUNT"
LOG_ENV = "EXAMPLE_PLATFORM_LOG"


def _log(hook: str, **details) -> None:
    """One line per hook call in the file EXAMPLE_PLATFORM_LOG names (appends are atomic)."""
    path = os.environ.get(LOG_ENV)
    if path:
        line = json.dumps({"pid": os.getpid(), "hook": hook, "t": time.time(), **details})
        with open(path, "a") as out:
            out.write(line + "\n")


class _HostEvent:
    """Host kernels run synchronously: an event is complete when recorded. A device returns
    its runtime's event (recorded on a stream, waited on by another)."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class ExamplePlatform(Platform):
    # ---- identity: the names the rest of Eddy and Ray see -----------------------------------
    name = "example"  # = the entry point's name
    device_type = "cpu"  # a real device: its torch device type ("acme", PrivateUse1)
    ray_resource = "EXAMPLE_DEVICE"  # what an actor asks Ray for; Ray only counts it
    visible_devices_env = "EXAMPLE_VISIBLE_DEVICES"  # the device runtime's own variable
    description = "template plug-in (host CPU posing as EXAMPLE_DEVICE accelerators)"
    detect_priority = None  # only by name: a template never displaces a real device

    def unavailable_reason(self) -> str | None:
        # A real device: None only when the runtime library loads and sees a device. Return a
        # sentence, never raise (a raise still only makes this platform unusable, with a
        # warning, but the sentence is what the user reads).
        return None

    def device_count(self) -> int:
        visible = os.environ.get(self.visible_devices_env)
        if visible:  # bound to its device (`bind_device`): the process sees that one
            return len(visible.split(","))
        return int(os.environ.get(COUNT_ENV, "4"))

    def properties(self, index: int = 0) -> DeviceProperties:
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceProperties(name=f"example device {index} (host CPU)", total_memory=pages)

    # ---- placement ------------------------------------------------------------------------
    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")  # a real device: torch.device(self.device_type, local_rank)

    def set_device(self, local_rank: int) -> None:
        pass  # a real device: torch.acme.set_device(local_rank)

    def bind_device(self, index: int, *, narrowed: bool = False) -> int:
        local = super().bind_device(index, narrowed=narrowed)  # sets EXAMPLE_VISIBLE_DEVICES
        _log("bind_device", index=index, local=local, narrowed=narrowed)
        return local

    # ---- execution ------------------------------------------------------------------------
    def synchronize(self) -> None:
        pass  # host kernels are synchronous; a device waits for its queue here

    def new_stream(self) -> torch.Stream:
        return torch.Stream(device="cpu")

    def current_stream(self) -> torch.Stream:
        return torch.cpu.current_stream()

    def new_event(self, enable_timing: bool = False) -> _HostEvent:
        return _HostEvent()

    # ---- memory ---------------------------------------------------------------------------
    def memory_info(self) -> MemoryInfo:
        total = self.properties().total_memory
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as statm:  # resident set: what the "device" holds
            used = int(statm.read().split()[1]) * page
        peak = max(used, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        free = os.sysconf("SC_AVPHYS_PAGES") * page
        return MemoryInfo(free=min(free, total), total=total, allocated=used,
                          peak_allocated=peak)

    def empty_cache(self) -> None:
        pass

    def reset_peak_memory(self) -> None:
        pass

    def release_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        _log("release_memory", tags=list(tags))

    def restore_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        _log("restore_memory", tags=list(tags))

    # ---- randomness -----------------------------------------------------------------------
    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state()}  # a device adds its generator's state

    # ---- collectives ----------------------------------------------------------------------
    def dist_backend(self) -> str:
        return "gloo"  # a device: its collective library's torch.distributed backend

    # ---- precision ------------------------------------------------------------------------
    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16)

    # ---- profiling: the phases Eddy marks --------------------------------------------------
    @contextlib.contextmanager
    def profile_range(self, name: str) -> Iterator[None]:
        # A real device: start/end ranges of its profiler (they may overlap: see the base)
        _log("range_start", name=name)
        try:
            yield
        finally:
            _log("range_end", name=name)

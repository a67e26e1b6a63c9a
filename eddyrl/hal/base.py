"""The `Platform` base class: what Eddy needs from a kind of device.

Every default delegates to PyTorch's device-generic APIs (`torch.get_device_module`,
`torch.Stream`/`torch.Event`, `torch.amp.autocast`, `Backend.default_device_backend_map`), so a
platform file overrides only what really differs. Nothing outside `eddyrl/hal/` may name a device
(a test enforces it): the rest of Eddy asks its `Platform` instead.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Iterator

import torch


@dataclass(frozen=True, slots=True)
class DeviceProperties:
    name: str
    total_memory: int  # bytes; 0 where unknown


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    free: int
    total: int
    allocated: int
    peak_allocated: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def loopback_interface() -> str:
    """Name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    import socket

    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def interface_of(address: str) -> str:
    """The network interface that holds IPv4 `address` on this machine (Linux: SIOCGIFADDR on
    each interface): where the collective libraries' sockets go on a cluster node."""
    import fcntl
    import socket
    import struct

    if address.startswith("127."):
        return loopback_interface()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    raise RuntimeError(f"no network interface of this machine holds {address} (the node's "
                       "cluster address): the collective libraries would not know where to "
                       "listen")


class Platform:
    """One kind of device. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    device_type: ClassVar[str]
    ray_resource: ClassVar[str | None] = None  # Ray resource name; None means "CPU only"
    visible_devices_env: ClassVar[str | None] = None  # e.g. the variable Ray sets per actor
    description: ClassVar[str] = ""
    # Detection picks the available platform with the highest priority; None = only by name.
    detect_priority: ClassVar[int | None] = None
    _bound_index: int | None = None  # set by `bind_device`, per instance
    _broken: str | None = None  # why a hook that raised made this platform unusable
    _copy_stream: Any = None  # `copy_to_host_async`'s side stream, made at its first use

    # ---- identity -------------------------------------------------------------------------
    def module(self) -> Any:
        """The torch device module (`torch.cuda`, `torch.npu`, `torch.cpu`)."""
        return torch.get_device_module(self.device_type)

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """None when usable here, else one sentence saying why not."""
        try:
            ok = self.module().is_available()
        except Exception as exc:  # a half-installed vendor stack must not crash discovery
            return f"{type(exc).__name__}: {exc}"
        return None if ok else f"no {self.device_type} device is visible to this process"

    def check_usable(self) -> str | None:
        """What the rest of Eddy asks (do not override): `unavailable_reason` and
        `is_available` together, and never an exception. A plug-in whose hooks raise (a
        half-installed vendor library) is unusable with a warning naming it; it must not take
        discovery down for every other platform."""
        if self._broken is not None:
            return self._broken
        hook = "unavailable_reason"
        try:
            reason = self.unavailable_reason()
            hook = "is_available"
            if reason is None and not self.is_available():
                reason = f"{type(self).__name__}.is_available() returned False"
        except Exception as exc:
            # once broken, always: the warning is given once, and no later call flips it
            self._broken = reason = hook_failed(self, hook, exc)
        return reason

    def device_count(self) -> int:
        return self.module().device_count() if self.check_usable() is None else 0

    def properties(self, index: int = 0) -> DeviceProperties:
        props = self.module().get_device_properties(index)
        return DeviceProperties(name=props.name, total_memory=int(props.total_memory))

    def describe(self) -> dict[str, Any]:
        """Everything `eddy platforms` prints about this platform; a hook that raises shows
        as the platform's problem, not as a traceback."""
        reason = self.check_usable()
        info: dict[str, Any] = {
            "name": self.name,
            "available": reason is None,
            "reason": reason,
            "device_type": getattr(self, "device_type", "-"),
            "backend": "-",
            "ray_resource": self.ray_resource or "-",
            "visible_devices_env": self.visible_devices_env or "-",
            "device_count": 0,
            "device_name": "-",
            "memory_total": 0,
        }
        try:
            info["backend"] = self.dist_backend()
            if reason is None:
                props = self.properties(0)
                info.update(device_count=self.device_count(), device_name=props.name,
                            memory_total=props.total_memory)
        except Exception as exc:
            info.update(available=False, reason=hook_failed(self, "describe", exc))
        return info

    # ---- placement ------------------------------------------------------------------------
    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.device_type, local_rank)

    def set_device(self, local_rank: int) -> None:
        self.module().set_device(local_rank)

    def local_rank(self) -> int:
        """This process's device index on its node: the one `bind_device` was given, else
        `LOCAL_RANK` (torchrun's), else 0."""
        if self._bound_index is not None:
            return self._bound_index
        return int(os.environ.get("LOCAL_RANK", "0"))

    def bind_device(self, index: int, *, narrowed: bool = False) -> int:
        """Give this process device `index` of its node, before it touches a device; returns
        the index its tensors use from now on. The runtime calls it in every actor with the
        index it chose for it (`runtime/devices.py`). `narrowed`: Ray has already made only
        that device visible (it does so for the accelerators it knows, setting the
        visible-devices variable per actor), so the process sees it as device 0.
        Otherwise a platform with a `visible_devices_env` gets that variable set to `index`
        (a vendor runtime reads it when it initialises: the process then sees one device,
        index 0), and one without addresses device `index` directly."""
        if narrowed:
            local = 0
        elif self.visible_devices_env:
            os.environ[self.visible_devices_env] = str(index)
            local = 0
        else:
            local = index
        self._bound_index = local
        return local

    def device_mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None):
        """A `DeviceMesh` over the default process group (which must be initialised)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, shape, mesh_dim_names=names)

    # ---- execution ------------------------------------------------------------------------
    def synchronize(self) -> None:
        self.module().synchronize()

    def new_stream(self) -> torch.Stream:
        return torch.Stream(device=self.device(self.local_rank()))

    def new_event(self, enable_timing: bool = False) -> torch.Event:
        return torch.Event(device=self.device(self.local_rank()), enable_timing=enable_timing)

    def current_stream(self) -> torch.Stream:
        return self.module().current_stream()

    # ---- host copies ----------------------------------------------------------------------
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of host memory (uint8), page-locked: a copy from the device into pageable
        memory is synchronous, into pinned memory it can run beside the compute. A backend
        without a pinned-memory allocator (a plug-in's, say) gets pageable memory, and
        `copy_to_host_async` then copies synchronously."""
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # "pin_memory=True requires ... an accelerator backend"
            return torch.empty(nbytes, dtype=torch.uint8)

    def copy_to_host_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Copy each (source, host destination) pair on a side stream, after the work queued
        so far on the current one; returns an event that completes with the last copy (its
        `synchronize()` waits). The sources must not change, the destinations not be read,
        until then; destinations from `host_buffer` make the copies non-blocking."""
        if not all(destination.is_pinned() for _, destination in pairs):
            for source, destination in pairs:  # pageable memory: a plain, finished copy
                destination.copy_(source)
            self.synchronize()
            return _CopiedEvent()
        if self._copy_stream is None:
            self._copy_stream = self.new_stream()
        stream = self._copy_stream
        stream.wait_stream(self.current_stream())
        with stream:
            for source, destination in pairs:
                destination.copy_(source, non_blocking=True)
                if source.device.type == self.device_type:
                    source.record_stream(stream)  # not reused by the allocator before the copy
        event = self.new_event()
        event.record(stream)
        return event

    # ---- memory ---------------------------------------------------------------------------
    def device_memory_bytes(self, index: int = 0) -> int:
        """Memory of device `index` in bytes, asked before any engine starts (`eddy plan`, the
        preflight memory check): the device's total, as its properties give it."""
        return self.properties(index).total_memory

    def memory_info(self) -> MemoryInfo:
        mod = self.module()
        free, total = mod.mem_get_info()
        return MemoryInfo(free=int(free), total=int(total),
                          allocated=int(mod.memory_allocated()),
                          peak_allocated=int(mod.max_memory_allocated()))

    def empty_cache(self) -> None:
        self.module().empty_cache()

    def reset_peak_memory(self) -> None:
        self.module().reset_peak_memory_stats()

    def release_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Called by an engine going to sleep after it dropped its tensors: return cached
        blocks to the device so another role (e.g. the trainer) can use them."""
        self.synchronize()
        self.empty_cache()

    def restore_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Called by an engine waking up, before it re-allocates. Nothing to do by default."""

    # ---- randomness -----------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds the CPU generator and every registered device

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device_type != "cpu" and self.check_usable() is None:
            state[self.device_type] = self.module().get_rng_state()
        return state

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if self.device_type in state and self.device_type != "cpu":
            self.module().set_rng_state(state[self.device_type])

    # ---- collectives ----------------------------------------------------------------------
    def dist_backend(self) -> str:
        """The collective backend for tensors on this device (gloo / nccl / hccl ...)."""
        import torch.distributed as dist

        return dist.Backend.default_device_backend_map.get(self.device_type, "gloo")

    def composite_backend(self) -> str:
        """Backend string for `init_process_group`: CPU tensors always go over gloo, so that
        metadata collectives work next to device collectives (`cpu:gloo,cuda:nccl`)."""
        if self.device_type == "cpu":
            return "cpu:gloo"
        return f"cpu:gloo,{self.device_type}:{self.dist_backend()}"

    def socket_env(self, interface: str, address: str) -> dict[str, str]:
        """Variables that put the collective libraries' sockets on `interface` (which holds
        `address`): gloo here; NCCL / HCCL add theirs. Without them gloo binds to the host
        name's address, which on a cluster node may not be the network the cluster uses."""
        return {"GLOO_SOCKET_IFNAME": interface}

    def loopback_env(self) -> dict[str, str]:
        """`socket_env` for the loopback interface: single-machine runs and tests."""
        return self.socket_env(loopback_interface(), "127.0.0.1")

    def use_network(self, address: str | None) -> None:
        """Before joining a group: keep this process's collective sockets on the interface of
        `address` (its node's cluster address), or on loopback when None. A value the user
        set wins."""
        env = self.loopback_env() if address is None else \
            self.socket_env(interface_of(address), address)
        for key, value in env.items():
            os.environ.setdefault(key, value)

    def init_process_group(self, rank: int, world_size: int, init_method: str | None,
                           timeout_s: float = 600.0, *, local: bool = False,
                           store: Any = None, address: str | None = None) -> None:
        """Join the default group. `init_method` is `file://...` (one machine, no listening
        socket) or `tcp://host:port`; or `store`, a store already made (see
        `hal.rendezvous`). `local=True` keeps all traffic on loopback; else `address` (this
        node's cluster address) says which interface the collectives use."""
        import torch.distributed as dist

        if local or address is not None:
            self.use_network(None if local else address)
        for key, value in self.collective_error_env().items():  # a value the user set wins
            os.environ.setdefault(key, value)
        if self.device_type != "cpu" and self.check_usable() is None:
            self.set_device(self.local_rank())
        dist.init_process_group(backend=self.composite_backend(),
                                init_method=None if store is not None else init_method,
                                store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self._name_default_backend()

    def collective_error_env(self) -> dict[str, str]:
        """Environment for a group whose collectives can fail: a collective that fails or
        times out raises in the rank's own thread, and the process lives on to leave the
        group and join a new one (a lost trainer rank recovered in place,
        docs/reliability.md). Gloo does this already; device backends override."""
        return {}

    def _name_default_backend(self) -> None:
        """torch (2.13) names the default group's "default backend type" on some paths of
        `init_process_group` only: with a per-device backend string ("cpu:gloo,...") and any
        backend plugin registered (importing FSDP registers torch's own `fake` one), it leaves
        it undefined, and `destroy_process_group` then prints "No backend of type 0 found ...
        Assuming no hooks are registered" into every run's output. Eddy registers no hooks, so
        the warning is harmless; naming the type as torch does on its other paths (nccl, else
        a plugin backend of this device, else gloo) removes it."""
        import torch.distributed as dist

        group = dist.group.WORLD
        if group is None or group._get_backend_name() != "undefined":
            return
        backends = {pair.split(":")[1] for pair in self.composite_backend().split(",")}
        kind = dist.ProcessGroup.BackendType
        if "nccl" in backends:
            group._set_default_backend(kind.NCCL)
        elif any(name.upper() in dist.Backend._plugins for name in backends):
            group._set_default_backend(kind.CUSTOM)
        else:
            group._set_default_backend(kind.GLOO)

    def new_standalone_group(self, store: Any, rank: int, world_size: int,
                             timeout_s: float = 600.0) -> Any:
        """A process group outside the default world (e.g. trainer + rollout workers for weight
        broadcast) that does not disturb the trainer's own group. Platforms override this to
        construct their device backend; the default is gloo, which moves CPU tensors."""
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world_size,
                                     datetime.timedelta(seconds=timeout_s))

    # ---- precision ------------------------------------------------------------------------
    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Whether autocast to `dtype` works here (torch warns and disables it otherwise)."""
        if dtype == torch.float32:
            return True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autocast(device_type=self.device_type, dtype=dtype):
                    pass
            except (RuntimeError, ValueError):
                return False
        return not any("not supported" in str(w.message) for w in caught)

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
        if dtype is None or dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def varlen_attention(self, dtype: torch.dtype) -> str | None:
        """The transformers `attn_implementation` that runs sequences laid end to end, told
        apart by `position_ids` restarting at 0, in `dtype` with no mask: a variable-length
        kernel, nothing [T, T]. None: packed training builds a dense mask (attention.py)."""
        return None

    # ---- profiling, model patches, engines -------------------------------------------------
    @contextlib.contextmanager
    def profile_range(self, name: str) -> Iterator[None]:
        """A named range in the vendor profiler's timeline (nvtx, mstx); a no-op by default.
        Ranges may overlap and end in any order (concurrent generate calls of one engine):
        use the profiler's start/end ranges, not a push/pop stack. Eddy's names: eddy.rollout.
        generate / forward, eddy.train.step / forward / backward / optimizer / logprobs /
        offload / onload, eddy.weights.export / send / receive / apply."""
        yield

    def apply_model_patches(self, model: torch.nn.Module) -> torch.nn.Module:
        """Swap in fused kernels the platform provides; returns the (possibly same) model."""
        return model

    def inference_engine_env(self) -> dict[str, str]:
        """Environment variables a vendor inference engine needs on this platform."""
        return {}

    def weight_channels(self, peer: "Platform") -> tuple[str, ...]:
        """The weight channels this platform can use with `peer` (as sender or receiver),
        best first. `collective` needs both ends on like accelerators (one device backend),
        `object_store` is host tensors between CPUs, `host` (staged through host memory, then
        copied onto the receiver's device) works between any two platforms. Both ends are
        asked (`choose_weight_channel`): a platform drops what its devices cannot do."""
        if peer.name != self.name:
            return ("host",)
        if self.device_type == "cpu":
            return ("object_store", "host")
        return ("collective", "host")

    def ray_actor_resources(self, fraction: float = 1.0) -> dict[str, Any]:
        """Ray `.options(...)` arguments asking for `fraction` of one device."""
        if self.ray_resource is None:
            return {}
        return {"resources": {self.ray_resource: fraction}}

    def ray_bundle(self, devices: int = 1) -> dict[str, float]:
        """The device part of a Ray placement-group bundle holding `devices` whole devices
        (actors then share them by asking for fractions inside the bundle)."""
        return {self.ray_resource: float(devices)} if self.ray_resource else {}

    def ray_node_resources(self) -> dict[str, float]:
        """The devices of this node as Ray resources, declared when Eddy starts a local Ray
        (a cluster's nodes declare them at `ray start --resources`). Ray counts the
        accelerators it knows by itself (GPU, NPU: those platforms return {}); for any other
        `ray_resource` this is the platform's own device count."""
        if self.ray_resource is None:
            return {}
        return {self.ray_resource: float(self.device_count())}

    def __repr__(self) -> str:
        return f"<Platform {self.name} ({self.device_type})>"


def choose_weight_channel(sender: Platform, receiver: Platform) -> str:
    """The channel both ends support, by the sender's preference; `host` when they share none
    (every platform can stage through host memory)."""
    theirs = set(receiver.weight_channels(sender))
    return next((kind for kind in sender.weight_channels(receiver) if kind in theirs), "host")


def hook_failed(platform: Platform, hook: str, exc: BaseException) -> str:
    """A plug-in hook raised: warn naming the platform and its class, and say it as the
    reason the platform is unusable."""
    cls = type(platform)
    reason = (f"{cls.__module__}.{cls.__qualname__}.{hook} raised "
              f"{type(exc).__name__}: {exc}")
    warnings.warn(f"platform {getattr(platform, 'name', cls.__name__)!r} is unusable: {reason}",
                  RuntimeWarning, stacklevel=3)
    return reason


class _CopiedEvent:
    """The event of copies that finished before `copy_to_host_async` returned."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

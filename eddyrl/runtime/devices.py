"""Which device of its node each actor uses, and which devices a local Ray declares.

Ray hands out the accelerators it knows (GPU, NPU): it makes only the assigned one visible to
the actor (the visible-devices variable) and says which through `get_accelerator_ids`. For any
other platform's `ray_resource` (a vendor's plug-in) Ray only counts: two actors asking for one
"ACME" each would both see every device and both use device 0. So there an actor claims a
device of its node itself, the lowest index nobody holds, with a `flock` on a file per device
in the node's temporary directory. The lock belongs to the open file: the kernel drops it
however the process ends (a forked child, using the device too, keeps it until it ends as
well), so a dead actor's device is free for its replacement, and two runs on one node never
take the same device. Colocated actors share one device: rollout worker i is given the
index trainer rank i claimed.

The index reaches the platform through `Platform.bind_device` (the HAL's job: it sets the
platform's visible-devices variable, or addresses the device by index).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..hal import Platform, get_platform

if TYPE_CHECKING:
    from .settings import RolePlatformNames


@dataclass
class DeviceBinding:
    """The device an actor uses: `index` on its node, `local` as the process addresses it,
    and `how` it was chosen: "ray" (Ray assigned it), "claimed" (locked here), "shared" (its
    colocated partner's), "process" (no Ray: LOCAL_RANK or 0) or "host" (a CPU platform)."""

    platform: str
    index: int
    local: int
    how: str
    lock: IO | None = None  # held open for the actor's lifetime ("claimed")

    def as_dict(self) -> dict[str, object]:
        return {"platform": self.platform, "index": self.index, "local": self.local,
                "how": self.how}


def node_resources(platforms: RolePlatformNames) -> dict[str, float]:
    """What a local Ray declares besides CPUs: both roles' devices as their platforms name
    them (`Platform.ray_node_resources`; Ray counts GPUs and NPUs itself)."""
    resources: dict[str, float] = {}
    for name in platforms.by_role().values():
        platform = get_platform(name, require_available=False)
        for name, count in platform.ray_node_resources().items():
            resources[name] = max(resources.get(name, 0.0), count)
    return resources


def bind_actor_device(platform: Platform, role: str, *, shared: int | None = None
                      ) -> DeviceBinding:
    """Bind this process to its device (before it touches one). `shared`: the device index
    of the colocated partner this actor takes turns with."""
    if platform.ray_resource is None:
        return DeviceBinding(platform.name, 0, platform.local_rank(), "host")
    assigned = _ray_assigned_ids(platform.ray_resource)
    if assigned is None:  # not a Ray actor (the local runtime, a test): as torchrun would
        return DeviceBinding(platform.name, platform.local_rank(), platform.local_rank(),
                             "process")
    if assigned:
        index = int(assigned[0])
        return DeviceBinding(platform.name, index, platform.bind_device(index, narrowed=True),
                             "ray")
    if shared is not None:
        return DeviceBinding(platform.name, shared, platform.bind_device(shared), "shared")
    index, lock = claim_device(platform, role)
    return DeviceBinding(platform.name, index, platform.bind_device(index), "claimed", lock)


def _ray_assigned_ids(resource: str) -> list[str] | None:
    """The ids Ray assigned this actor for `resource` ([] where Ray only counts it), or None
    outside a Ray worker process."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return None
    return list(context.get_accelerator_ids().get(resource, []))


def lock_directory(platform: Platform) -> Path:
    """Where this node's claims on `platform`'s devices are kept: per user, so one user's
    runs never wait on another's files."""
    path = Path(tempfile.gettempdir()) / f"eddy-devices-{os.getuid()}" / platform.name
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def claim_device(platform: Platform, role: str) -> tuple[int, IO]:
    """The lowest device index of this node no other process holds, and the open lock file
    that holds it (keep it open: closing it, or exiting, frees the device)."""
    count = platform.device_count()
    folder = lock_directory(platform)
    holders = []
    for index in range(count):
        handle = open(folder / f"{index}.lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holders.append(f"{index}: {handle.read().strip() or 'unknown'}")
            handle.close()
            continue
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} ({role})\n")
        handle.flush()
        return index, handle
    raise RuntimeError(
        f"every {platform.name} device of this node is held by another process ({count} "
        f"device(s); {'; '.join(holders) or 'none found'}; claims in {folder}): Ray counted one "
        f"free {platform.ray_resource}, so a process outside this run holds one")

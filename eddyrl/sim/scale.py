"""A scenario on a cluster `factor` times its size, for checking that the cost model scales by
physics (issue 35 holds published rows back and checks them at 2x and 0.5x the cluster): every
device count multiplied, each role's count kept a multiple of its tensor-parallel degree, the
rollout instances and training ranks following from it; the workload and the batch unchanged.

`scale_overrides` returns `key=value` overrides to put after the scenario's own (a row's size
overrides included) and before a policy's: the policies' scenario hooks (colocated devices,
verl's 16 prompts per server, Libra's bucket layout) then size themselves for the scaled cluster,
as they would for a scenario written at that size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from .config import SimRoleConfig, SimRunConfig


def scaled_devices(role: SimRoleConfig, factor: float, name: str) -> int:
    """`role.devices` x `factor`, to the nearest multiple of its tp (at least one group)."""
    if not factor > 0:
        raise ConfigError(f"scale {factor}: must be > 0")
    groups = round(role.devices * factor / role.tp)
    if groups < 1:
        raise ConfigError(f"scale {factor}: {name}.devices = {role.devices} x {factor} is less "
                          f"than one group of {name}.tp = {role.tp}")
    return groups * role.tp


def scale_overrides(config: SimRunConfig, factor: float) -> list[str]:
    """Overrides that put `config`'s scenario on `factor` times its devices (module docstring).
    The FSDP shard group (`sim.train.fsdp_size`) keeps its size where it still divides the
    trainer's devices, else shrinks to the largest size that does (their gcd)."""
    sim = config.sim
    rollout = scaled_devices(sim.rollout, factor, "sim.rollout")
    train = scaled_devices(sim.train, factor, "sim.train")
    out = [f"sim.rollout.devices={rollout}", f"sim.train.devices={train}",
           # one worker per instance, as the runtime counts them (sim/runtime.py, build)
           f"rollout.num_workers={rollout // sim.rollout.tp}"]
    if sim.train.fsdp_size:
        out.append(f"sim.train.fsdp_size={math.gcd(sim.train.fsdp_size, train)}")
    return out

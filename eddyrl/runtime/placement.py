"""Which platform each role runs on, and how weights cross between them.

`rollout.platform` and `train.platform` default to the top-level `platform`, so one run can
generate on one kind of device and train on another (e.g. Ascend rollout, NVIDIA training); the
weight channel then stages through host memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

from ..errors import PlatformError
from ..hal import Platform, choose_weight_channel, get_platform

if TYPE_CHECKING:
    from ..config import EddyConfig

ROLES = ("rollout", "train")


@dataclass(frozen=True, slots=True)
class RolePlatforms:
    rollout: Platform
    train: Platform

    @property
    def weight_channel(self) -> str:
        """The channel both roles' platforms support (`hal.choose_weight_channel`)."""
        return choose_weight_channel(self.train, self.rollout)


def role_platform_name(config: EddyConfig, role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    return getattr(config, role).platform or config.platform


def role_platform_names(config: EddyConfig) -> dict[str, str]:
    """Each role's platform name (in a config from `resolved.with_role_platforms`: the resolved
    ones)."""
    return {role: role_platform_name(config, role) for role in ROLES}


def resolve_role_platforms(config: EddyConfig, *, require_available: bool = True) -> RolePlatforms:
    """Resolve both roles' platforms (each raising a clear error when absent here; a role's
    own `<role>.platform` is named in it, the top-level `platform` names itself)."""
    chosen = {}
    for role in ROLES:
        try:
            chosen[role] = get_platform(role_platform_name(config, role),
                                        require_available=require_available)
        except PlatformError as exc:
            if getattr(config, role).platform is None:
                raise
            raise PlatformError(f"config key '{role}.platform': {exc}") from None
    return RolePlatforms(**chosen)


def weight_channel_kind(config: EddyConfig) -> str:
    """The weight channel of this run, resolved once (by the driver; the workers are told):
    `train.weight_channel` as configured, "auto" being what both roles' platforms support.
    Colocated roles share a device, and a device appears once per communicator, so an "auto"
    collective there goes through host memory instead."""
    kind = config.train.weight_channel
    if kind != "auto":
        return kind
    kind = resolve_role_platforms(config, require_available=False).weight_channel
    if kind == "collective" and config.cluster.placement == "colocated":
        return "host"
    return kind

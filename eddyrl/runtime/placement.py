"""Which platform each role runs on, and how weights cross between them.

`rollout.platform` and `train.platform` default to the top-level `platform`, so one run can
generate on one kind of device and train on another (e.g. Ascend rollout, NVIDIA training); the
weight channel then stages through host memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

from ..errors import PlatformError
from ..hal import Platform, get_platform

if TYPE_CHECKING:
    from ..config import EddyConfig

ROLES = ("rollout", "train")


@dataclass(frozen=True, slots=True)
class RolePlatforms:
    rollout: Platform
    train: Platform

    @property
    def weight_channel(self) -> str:
        return self.train.weight_channel_kind(self.rollout)


def role_platform_name(config: EddyConfig, role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    return getattr(config, role).platform or config.platform


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

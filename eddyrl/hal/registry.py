"""Finding platforms: built-ins, plug-ins from the `eddyrl.platforms` entry-point group, and the
choice between them (config key, else `EDDY_PLATFORM`, else detection)."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from importlib.metadata import entry_points

from ..errors import PlatformError
from .base import Platform, hook_failed
from .cpu import CpuPlatform
from .cuda import CudaPlatform
from .npu import NpuPlatform

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "eddyrl.platforms"
ENV_VAR = "EDDY_PLATFORM"
AUTO = "auto"

# Detection order: accelerators before the CPU. Plug-ins join only if they set `detect_priority`.
_BUILTINS: tuple[type[Platform], ...] = (CudaPlatform, NpuPlatform, CpuPlatform)


@functools.cache
def platform_classes() -> dict[str, type[Platform]]:
    """Every known platform by name; a broken plug-in is skipped with a warning naming it."""
    classes = {cls.name: cls for cls in _BUILTINS}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Platform)):
                raise TypeError(f"{ep.value} is not a subclass of eddyrl.hal.Platform")
            if ep.name != cls.name:
                raise TypeError(f"entry point name {ep.name!r} differs from {cls.__name__}.name "
                                f"{cls.name!r}")
        except Exception as exc:
            warnings.warn(f"platform plug-in {ep.name!r} ({ep.value}) failed to load and is "
                          f"skipped: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
            continue
        if ep.name in classes and classes[ep.name] is not cls:
            warnings.warn(f"platform plug-in {ep.name!r} ({ep.value}) replaces the platform of "
                          "the same name", RuntimeWarning, stacklevel=2)
        classes[ep.name] = cls
    return classes


def known_platforms() -> list[str]:
    return list(platform_classes())


@functools.cache
def _instance(name: str) -> Platform:
    """The one instance of platform `name` in this process. A constructor that raises (a
    vendor library half there) leaves an unusable instance whose `check_usable` says why."""
    cls = platform_classes()[name]
    try:
        return cls()
    except Exception as exc:
        broken = cls.__new__(cls)
        broken._broken = hook_failed(broken, "__init__", exc)
        return broken


def detect() -> Platform:
    """The best platform present here: an accelerator if any, else the CPU."""
    detectable = [cls for cls in platform_classes().values() if cls.detect_priority is not None]
    for cls in sorted(detectable, key=lambda cls: -cls.detect_priority):
        platform = _instance(cls.name)
        if platform.check_usable() is None:
            return platform
    return _instance(CpuPlatform.name)


def get_platform(name: str | None = None, *, require_available: bool = True) -> Platform:
    """The platform called `name`; None or "auto" falls back to `EDDY_PLATFORM`, then detection."""
    from_env = False
    if name in (None, "", AUTO):
        from_env = bool(os.environ.get(ENV_VAR))
        name = os.environ.get(ENV_VAR) or AUTO
    if name == AUTO:
        return detect()
    classes = platform_classes()
    if name not in classes:
        if from_env:  # the user may not know the variable is set: name it
            raise PlatformError(f"{ENV_VAR}={name!r} is not a known platform; known "
                                f"platforms: {', '.join(sorted(classes))} (or 'auto'); set "
                                f"{ENV_VAR} to one of them, or unset it to detect the "
                                "platform")
        raise PlatformError(f"unknown platform {name!r}; known platforms: "
                            f"{', '.join(sorted(classes))} (or 'auto')")
    platform = _instance(name)
    if require_available:
        reason = platform.check_usable()
        if reason is not None:
            source = f" (by {ENV_VAR}={name!r})" if from_env else ""
            raise PlatformError(f"platform {name!r} was requested{source} but is not usable "
                                f"here: {reason}")
    return platform

"""Hardware abstraction layer: the only package in Eddy that knows CUDA, Ascend NPU or CPU."""

from .base import DeviceProperties, MemoryInfo, Platform, choose_weight_channel
from .registry import AUTO, ENTRY_POINT_GROUP, ENV_VAR, detect, get_platform, known_platforms
from .weight_channel import (CollectiveChannel, HostChannel, WeightBucketSpec, WeightChannel,
                             iter_buckets, open_weight_channel)

__all__ = [
    "AUTO", "ENTRY_POINT_GROUP", "ENV_VAR", "CollectiveChannel", "DeviceProperties",
    "HostChannel", "MemoryInfo", "Platform", "WeightBucketSpec", "WeightChannel",
    "choose_weight_channel", "detect",
    "get_platform", "iter_buckets", "known_platforms", "open_weight_channel",
]

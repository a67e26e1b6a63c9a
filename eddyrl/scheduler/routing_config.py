"""The bucket router's config: the policy, the buckets (output length each is for, parallelism,
workers, batch size) and the router's statistics settings, and which rollout workers form each
bucket. Read by the router (`buckets.py`), the rollout workers (their batch size) and the
simulator; a run without routing never builds a router.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal, Sequence, get_args

from ..errors import ConfigError
from ..validation import check_choice, check_range, contradiction

RoutingPolicy = Literal["none", "bucket", "round_robin", "least_load", "fifo"]
POLICIES = get_args(RoutingPolicy)  # none: no router in a run


@dataclass(frozen=True, slots=True)
class BucketSpec:
    name: str
    max_tokens: int  # largest total output a request in this bucket is expected to need
    # tensor-parallel degree of each instance; 0: the rollout's own. The simulator builds each
    # bucket's instances with it (Libra gives long requests wider instances); real rollout
    # workers all run rollout's engine settings and ignore it.
    parallelism: int = 0
    workers: int = 1  # rollout workers (instances) in this bucket, in config order
    max_batch_size: int | None = None  # sequences each decodes together (None: rollout's)


def _default_buckets() -> list[BucketSpec]:
    return [BucketSpec("short", 3000), BucketSpec("medium", 6000), BucketSpec("long", 32768)]


@dataclass(kw_only=True, slots=True)
class RoutingConfig:
    # none: the version assignment alone places requests (least loaded); bucket: Libra;
    # round_robin, least_load, fifo: baselines of the same router, for comparison
    policy: RoutingPolicy = "none"
    buckets: list[BucketSpec] = field(default_factory=_default_buckets)  # by max_tokens, rising
    window: int = 200  # observations each tree node keeps
    rebuild_every: int = 100  # finished requests between refreshes of the node statistics
    min_observations: int = 8  # a node is trusted from this many observations on
    milestones: list[int] = field(default_factory=lambda: [256, 1024, 4096])  # single-turn
    payload_bytes: list[int] = field(default_factory=lambda: [1024, 16384])  # medium, large from

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.policy", self.policy, POLICIES)
        check_range(f"{prefix}.window", self.window, 1)
        check_range(f"{prefix}.rebuild_every", self.rebuild_every, 1)
        check_range(f"{prefix}.min_observations", self.min_observations, 1)
        if self.min_observations > self.window:
            raise contradiction(
                f"{prefix}.min_observations = {self.min_observations} exceeds {prefix}.window "
                f"= {self.window}: no node could ever be trusted. Lower min_observations")
        if not self.buckets:
            raise ConfigError(f"config key '{prefix}.buckets' is empty; give at least one "
                              f"bucket (name, max_tokens, parallelism)")
        for i, spec in enumerate(self.buckets):
            if not spec.name:
                raise ConfigError(f"config key '{prefix}.buckets[{i}].name' is empty")
            check_range(f"{prefix}.buckets[{i}].max_tokens", spec.max_tokens, 1)
            check_range(f"{prefix}.buckets[{i}].parallelism", spec.parallelism, 0)
            check_range(f"{prefix}.buckets[{i}].workers", spec.workers, 1)
            if spec.max_batch_size is not None:
                check_range(f"{prefix}.buckets[{i}].max_batch_size", spec.max_batch_size, 1)
        names = [spec.name for spec in self.buckets]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise contradiction(f"{prefix}.buckets repeats the name(s) {repeated}; "
                                f"each bucket needs its own name")
        limits = [spec.max_tokens for spec in self.buckets]
        if any(a >= b for a, b in itertools.pairwise(limits)):
            raise contradiction(f"{prefix}.buckets max_tokens = {limits} must rise strictly: "
                                f"the router picks the first bucket that fits")
        _check_rising(f"{prefix}.milestones", self.milestones)
        _check_rising(f"{prefix}.payload_bytes", self.payload_bytes)
        if len(self.payload_bytes) != 2:
            raise ConfigError(f"config key '{prefix}.payload_bytes' = {self.payload_bytes} needs "
                              f"exactly 2 thresholds: where medium and large payloads start")


def bucket_instances(config: RoutingConfig) -> dict[str, list[int]]:
    """Worker ids per bucket: the buckets take consecutive workers in config order."""
    workers = [spec.workers for spec in config.buckets]
    return consecutive([spec.name for spec in config.buckets], workers,
                       list(range(sum(workers))))


def consecutive(names: Sequence[str], counts: Sequence[int], ids: Sequence[int]
                ) -> dict[str, list[int]]:
    """`ids` cut in order into runs of `counts`, one per name."""
    offsets = itertools.accumulate(counts, initial=0)
    return {name: list(ids[start:start + count])
            for name, start, count in zip(names, offsets, counts)}


def bucket_of_worker(config: RoutingConfig, worker: int) -> BucketSpec:
    for spec, ids in zip(config.buckets, bucket_instances(config).values()):
        if worker in ids:
            return spec
    raise ValueError(f"worker {worker} is in no bucket of {bucket_instances(config)}")


def worker_batch_size(config: RoutingConfig, worker: int, default: int) -> int:
    """Sequences rollout worker `worker` decodes together: its bucket's setting, if routing
    gives it one (e.g. wide batches for short requests, narrow ones for long), else `default`."""
    if config.policy != "none":
        size = bucket_of_worker(config, worker).max_batch_size
        if size is not None:
            return size
    return default


def _check_rising(key: str, values: list[int]) -> None:
    for i, value in enumerate(values):
        check_range(f"{key}[{i}]", value, 1)
    if any(a >= b for a, b in itertools.pairwise(values)):
        raise ConfigError(f"config key {key!r} = {values} must rise strictly")

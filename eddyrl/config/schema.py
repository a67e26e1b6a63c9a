"""The root of Eddy's config tree. Each section is a typed dataclass owned by its component and
validated by its own `validate(prefix)`; the root adds the checks that span sections."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

from .checks import check_choice, check_range


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    # None: start Ray on this machine, bound to loopback. "auto" or "host:port": join a cluster.
    address: str | None = None
    num_cpus: int | None = None  # CPUs Ray may use when it starts locally (None: all)
    timeout_s: float = 600.0  # longest wait for any worker call or collective before an error

    def validate(self, prefix: str) -> None:
        if self.num_cpus is not None:
            check_range(f"{prefix}.num_cpus", self.num_cpus, 1)
        check_range(f"{prefix}.timeout_s", self.timeout_s, 0, lo_open=True)


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: str = "hf"
    platform: str | None = None  # None: the top-level `platform`
    num_workers: int = 1

    def validate(self, prefix: str) -> None:
        from ..engines.registry import INFERENCE_ENGINES

        check_choice(f"{prefix}.engine", self.engine, INFERENCE_ENGINES)
        _check_platform_name(f"{prefix}.platform", self.platform)
        check_range(f"{prefix}.num_workers", self.num_workers, 1)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    engine: str = "fsdp"
    platform: str | None = None  # None: the top-level `platform`
    num_workers: int = 1  # data-parallel ranks

    def validate(self, prefix: str) -> None:
        from ..engines.registry import TRAIN_ENGINES

        check_choice(f"{prefix}.engine", self.engine, TRAIN_ENGINES)
        _check_platform_name(f"{prefix}.platform", self.platform)
        check_range(f"{prefix}.num_workers", self.num_workers, 1)


def _check_platform_name(key: str, name: str | None) -> None:
    from ..hal import AUTO, known_platforms

    if name is not None:
        check_choice(key, name, [AUTO, *known_platforms()])


@dataclass(kw_only=True, slots=True)
class EddyConfig:
    platform: str = "auto"  # a platform name, or "auto": EDDY_PLATFORM, else detection
    seed: int = 0
    run_dir: str | None = None  # None: runs/<timestamp>
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self, prefix: str = "") -> None:
        _check_platform_name("platform", self.platform)
        check_range("seed", self.seed, 0)
        for f in fields(self):
            section = getattr(self, f.name)
            if is_dataclass(section):
                section.validate(f.name)

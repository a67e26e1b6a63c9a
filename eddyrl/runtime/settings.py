"""What each worker is told of its run: its own sections, resolved once by the driver
(`eddyrl/resolved.py`), never the whole config. Frozen dataclasses, so a worker cannot change
what it was told, and Ray pickles them into the actors' constructors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.config import AlgorithmConfig
from ..engines.config import TrainConfig
from ..scheduler.routing_config import RoutingConfig
from .config import ClusterConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RolePlatformNames:
    """Each role's platform, as the driver resolved it (`auto` and `EDDY_PLATFORM` already
    looked up there, not in each actor's own environment)."""

    rollout: str
    train: str

    def by_role(self) -> dict[str, str]:
        return {"rollout": self.rollout, "train": self.train}


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutWorkerSettings:
    """A rollout worker's engine, its process, and the gradient replica the elastic pool may
    ask it to hold."""

    platforms: RolePlatformNames  # its own; the trainer's is the weight channel's other end
    cluster: ClusterConfig  # threads per worker, call deadlines
    seed: int
    engine: str
    engine_options: dict[str, Any]  # the inference engine's memory options
    max_batch_size: int
    routing: RoutingConfig  # each worker's own batch size (`worker_batch_size`)
    partial_rollout: bool
    lent_to_training: bool  # the elastic pool may lend it: its replica needs the weights here
    train: TrainConfig  # the replica's forward options
    algorithm: AlgorithmConfig  # the replica's loss
    sampling_temperature: float  # the sampler's (`core.update.logit_temperature` of it)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSettings:
    """A trainer rank's engine, update and process."""

    platforms: RolePlatformNames  # its own; the rollout's is the weight channel's other end
    cluster: ClusterConfig  # threads per worker, deadlines, whether on one machine
    seed: int
    train: TrainConfig
    algorithm: AlgorithmConfig
    sampling_temperature: float  # the sampler's (`core.update.logit_temperature` of it)
    rollout_engine: str  # the form the weights are exported in (low-rank receivers)


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeSettings:
    """What a runtime (`LocalRuntime`, `RayRuntime`) needs to start and wire its workers."""

    cluster: ClusterConfig
    rollout_workers: int
    trainer_ranks: int
    weight_channel: str  # `placement.weight_channel_kind`, resolved by the driver
    rollout: RolloutWorkerSettings
    trainer: TrainerSettings

    @property
    def platforms(self) -> RolePlatformNames:
        return self.trainer.platforms

    def workers(self, role: str) -> int:
        """How many actors `role` ("rollout" or "train") has."""
        return {"rollout": self.rollout_workers, "train": self.trainer_ranks}[role]

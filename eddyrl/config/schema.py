"""The root of Eddy's config tree. Each section is a typed dataclass owned by the component it
configures and validated by its own `validate(prefix)`; the root adds cross-section checks."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

from ..core.config import AlgorithmConfig, LoopConfig
from ..core.replay import ReplayConfig
from ..engines.config import RolloutConfig, TrainConfig, check_platform_name
from ..models.config import ModelConfig
from ..runtime.config import ClusterConfig
from ..tasks.config import DataConfig
from ..validation import check_range, contradiction


@dataclass(kw_only=True, slots=True)
class EddyConfig:
    platform: str = "auto"  # a platform name, or "auto": EDDY_PLATFORM, else detection
    seed: int = 0
    run_dir: str | None = None  # None: runs/<date>-<time>
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)

    def validate(self, prefix: str = "") -> None:
        check_platform_name("platform", self.platform)
        check_range("seed", self.seed, 0)
        for f in fields(self):
            section = getattr(self, f.name)
            if is_dataclass(section):
                section.validate(f.name)
        slots = int(self.replay.max_fraction * self.loop.batch_prompts + 1e-9)
        if slots >= self.loop.batch_prompts:
            raise contradiction(
                f"replay.max_fraction = {self.replay.max_fraction} leaves no fresh group in a "
                f"batch of loop.batch_prompts = {self.loop.batch_prompts}; every step needs "
                "fresh data (max_fraction < 1)")

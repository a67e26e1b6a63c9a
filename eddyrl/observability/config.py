"""The `observe` config section: where a run's metrics and trace go besides metrics.jsonl."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(kw_only=True, slots=True)
class ObserveConfig:
    # TensorBoard event files in <run_dir>/tensorboard, one scalar per metric per step.
    # None: when a writer is installed (tensorboard or tensorboardX: `pip install
    # 'eddyrl[observe]'`); true: required (an error at start without one); false: none.
    tensorboard: bool | None = None
    # Weights & Biases: the project to log to (None: no W&B). Needs `pip install wandb`;
    # WANDB_MODE=offline logs to <run_dir>/wandb with no network.
    wandb_project: str | None = None
    wandb_entity: str | None = None  # team or user; None: wandb's default
    # <run_dir>/trace.json: every worker's activity (Perfetto / Chrome trace, ui.perfetto.dev)
    trace: bool = True

    def validate(self, prefix: str) -> None:
        for key in ("wandb_project", "wandb_entity"):
            value = getattr(self, key)
            if value is not None and not str(value).strip():
                raise ConfigError(f"config key '{prefix}.{key}' = {value!r} is empty; give a "
                                  "name, or null for none")
        if self.wandb_entity is not None and self.wandb_project is None:
            raise ConfigError(f"config key '{prefix}.wandb_entity' = {self.wandb_entity!r} is "
                              f"set but '{prefix}.wandb_project' is not; W&B logs only with "
                              "a project")

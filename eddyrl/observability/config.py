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
    # held-out samples (prompt, response, answer, reward) kept at each evaluation: the first N
    # held-out prompts, in <run_dir>/samples.jsonl and TensorBoard / W&B when on; 0: none
    samples: int = 4

    def validate(self, prefix: str) -> None:
        if not isinstance(self.samples, int) or self.samples < 0:
            raise ConfigError(f"config key '{prefix}.samples' = {self.samples!r}: a number of "
                              "held-out samples to keep at each evaluation, 0 or more")
        for key in ("wandb_project", "wandb_entity"):
            value = getattr(self, key)
            if value is not None and not str(value).strip():
                raise ConfigError(f"config key '{prefix}.{key}' = {value!r} is empty; give a "
                                  "name, or null for none")
        if self.wandb_entity is not None and self.wandb_project is None:
            raise ConfigError(f"config key '{prefix}.wandb_entity' = {self.wandb_entity!r} is "
                              f"set but '{prefix}.wandb_project' is not; W&B logs only with "
                              "a project")

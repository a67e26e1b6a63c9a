"""A resolved run: what `eddy train` and `eddy eval` work out once from a validated config
(`launch.prepare`), in one typed object. Everything below the driver reads this, and each
worker only its own sections (`runtime/settings.py`); the loaded config itself is never
changed after validation.

`with_role_platforms` records the platforms resolved in the driver into a copy of the config:
that copy is what the run saves (config.yaml, the checkpoints' state) and what `eddy eval` or
a resume read back, so they use what was resolved here, not what `auto` or `EDDY_PLATFORM`
would find in another environment."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .core.controller import LoopSettings
from .core.rewarding import SafeReward
from .envs.hosting import EnvHost
from .runtime.placement import (ROLES, resolve_role_platforms, role_platform_name,
                                role_platform_names, weight_channel_kind)
from .runtime.settings import (RolePlatformNames, RolloutWorkerSettings, RuntimeSettings,
                               TrainerSettings)
from .tasks.prompts import PromptSet

if TYPE_CHECKING:
    from .config import EddyConfig


@dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    config: EddyConfig  # as validated, with the resolved platforms when `train` made it
    model_path: str  # the model's files on this machine
    tokenizer: Any  # a Hugging Face tokenizer, checked against the model's vocabulary
    train_set: PromptSet
    eval_set: PromptSet
    settings: LoopSettings  # the controller's (settings.env: the environments' `EnvHost`)
    reward: SafeReward  # the guarded reward, running in its user-code pool
    runtime: RuntimeSettings  # platforms per role, the weight channel, each worker's sections

    @property
    def platforms(self) -> dict[str, str]:
        return self.runtime.platforms.by_role()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        """Stop the user-code pools `prepare` started (no worker outlives its run)."""
        self.reward.close()
        if isinstance(self.settings.env, EnvHost):
            self.settings.env.close()


def runtime_settings(config: EddyConfig) -> RuntimeSettings:
    """The sections each worker reads, from the config (its platforms as they stand there:
    resolved ones after `with_role_platforms`)."""
    platforms = RolePlatformNames(**role_platform_names(config))
    rollout, train = config.rollout, config.train
    return RuntimeSettings(
        cluster=config.cluster, rollout_workers=rollout.num_workers,
        trainer_ranks=train.num_workers, weight_channel=weight_channel_kind(config),
        rollout=RolloutWorkerSettings(
            platforms=platforms, cluster=config.cluster, seed=config.seed,
            engine=rollout.engine, engine_options=config.rollout_engine_options(),
            max_batch_size=rollout.max_batch_size, routing=config.routing,
            partial_rollout=config.window.partial_rollout,
            lent_to_training=config.elastic.enabled, train=train,
            algorithm=config.algorithm, sampling_temperature=rollout.temperature),
        trainer=TrainerSettings(
            platforms=platforms, cluster=config.cluster, seed=config.seed, train=train,
            algorithm=config.algorithm, sampling_temperature=rollout.temperature,
            rollout_engine=rollout.engine))


def explicit_role_platforms(config: EddyConfig) -> dict[str, bool]:
    """Per role, whether the user named the platform (a name, not `auto`): only that may move
    a resumed run to another platform."""
    return {role: role_platform_name(config, role) not in ("", "auto") for role in ROLES}


def with_role_platforms(config: EddyConfig) -> EddyConfig:
    """A copy of `config` with each role's platform resolved once, here in the driver
    (`<role>.platform`, and `platform` where both agree); fails fast, in one sentence, if a
    platform is absent. `config` itself is left as it was loaded."""
    roles = resolve_role_platforms(config)
    recorded = copy.deepcopy(config)
    for role in ROLES:
        getattr(recorded, role).platform = getattr(roles, role).name
    if roles.train.name == roles.rollout.name:
        recorded.platform = roles.train.name
    return recorded

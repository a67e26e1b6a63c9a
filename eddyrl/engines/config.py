"""Config sections of the two engine roles: rollout (inference) and train."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import ConfigError
from ..validation import check_choice, check_positive, check_range


WeightChannelKind = Literal["auto", "collective", "object_store", "host"]


def check_platform_name(key: str, name: str | None) -> None:
    from ..hal import AUTO, known_platforms

    if name is not None:
        check_choice(key, name, [AUTO, *known_platforms()])


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: str = "hf"
    platform: str | None = None  # None: the top-level `platform`
    num_workers: int = 1
    n_samples: int = 8  # G: responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 54  # the longest arith answer (12 terms) fits
    max_batch_size: int = 256  # sequences one worker decodes together
    # (partial_rollout, migrate, fill_legacy: the version window's, `window.*`)

    def validate(self, prefix: str) -> None:
        from .registry import INFERENCE_ENGINES

        check_choice(f"{prefix}.engine", self.engine, INFERENCE_ENGINES)
        check_platform_name(f"{prefix}.platform", self.platform)
        check_range(f"{prefix}.num_workers", self.num_workers, 1)
        check_range(f"{prefix}.n_samples", self.n_samples, 1)
        if self.n_samples == 1:
            # every advantage estimator here is group-relative (eddyrl/core/advantages.py:
            # GRPO, and Dr. GRPO with algorithm.normalize_std = false)
            raise ConfigError(
                f"config key '{prefix}.n_samples' = 1 trains nothing: a response's advantage is "
                "its reward minus the mean of its prompt's group (GRPO, Dr. GRPO), so in a "
                "group of one it is always 0; sample at least 2 responses per prompt")
        check_range(f"{prefix}.temperature", self.temperature, 0)
        check_range(f"{prefix}.top_p", self.top_p, 0, 1, lo_open=True)
        check_range(f"{prefix}.top_k", self.top_k, 0)
        check_range(f"{prefix}.max_new_tokens", self.max_new_tokens, 1)
        check_range(f"{prefix}.max_batch_size", self.max_batch_size, 1)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    engine: str = "fsdp"
    platform: str | None = None  # None: the top-level `platform`
    num_workers: int = 1  # data-parallel ranks
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 64  # sequences per forward/backward on one rank
    mini_batches: int = 1  # optimizer steps per RL step (PPO-style updates over the batch)
    # rows of one prompt share its forward pass: one packed sequence per prompt, its responses
    # after it (engines/training/packing.py); a pack holds at most max_packed_tokens tokens
    share_prompts: bool = True
    max_packed_tokens: int = 8192
    bucket_mb: int = 64  # weight-sync bucket size
    weight_channel: WeightChannelKind = "auto"  # auto: as the platforms agree; or force one (for tests)

    def validate(self, prefix: str) -> None:
        from .registry import TRAIN_ENGINES

        check_choice(f"{prefix}.engine", self.engine, TRAIN_ENGINES)
        check_platform_name(f"{prefix}.platform", self.platform)
        check_range(f"{prefix}.num_workers", self.num_workers, 1)
        check_positive(f"{prefix}.lr", self.lr)
        check_range(f"{prefix}.weight_decay", self.weight_decay, 0)
        check_positive(f"{prefix}.grad_clip", self.grad_clip)
        check_range(f"{prefix}.micro_batch_size", self.micro_batch_size, 1)
        check_range(f"{prefix}.mini_batches", self.mini_batches, 1)
        check_range(f"{prefix}.max_packed_tokens", self.max_packed_tokens, 1)
        check_range(f"{prefix}.bucket_mb", self.bucket_mb, 1)
        check_choice(f"{prefix}.weight_channel", self.weight_channel,
                     get_args(WeightChannelKind))

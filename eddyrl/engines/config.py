"""Config sections of the two engine roles: rollout (inference) and train."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..errors import ConfigError
from ..validation import check_choice, check_positive, check_range, check_temperature


WeightChannelKind = Literal["auto", "collective", "object_store", "host"]
ParamDtypeKind = Literal["fp32", "bf16", "fp16"]
RankLossKind = Literal["replace", "shrink", "stop"]
CheckpointingKind = Literal["none", "full", "selective"]
OffloadKind = Literal["none", "optimizer", "all"]
AttentionKind = Literal["auto", "mask", "varlen"]
# the torch names of the dtypes above, as the engines take them
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# inference engines whose KV cache is a pool of blocks sized once (`rollout.memory_fraction`)
POOLED_KV_ENGINES = ("vllm",)
# inference engines that record each token's experts for rollout routing replay
ROUTING_ENGINES = ("hf", "vllm")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    # --- memory (docs/engines.md, "The rollout engine's memory"; `eddy plan` predicts it) ---
    # the engine's weights and KV cache: fp32, or bf16 / fp16 (refused where the rollout
    # platform has no such dtype); log-probs are computed in fp32 from the logits either way
    dtype: ParamDtypeKind = "fp32"
    # vllm's KV cache: 0 sizes it for max_batch_size sequences of the run's longest length
    # (data.max_prompt_tokens + max_new_tokens); a share of the device's memory (0.9: vLLM's
    # gpu_memory_utilization) makes the engine take that much, weights included, and pool
    # what is left for KV blocks shared by the batch (paged: sequences hold what they use)
    memory_fraction: float = 0.0
    # rollout routing replay (R3), mixture-of-experts models only: the engine records each
    # token's experts and the trainer's forward routes it to them (engines/training/
    # routing_replay.py), so rollout and trainer log-probs differ by numerics, not routing
    routing_replay: bool = False
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
        check_temperature(
            f"{prefix}.temperature", self.temperature,
            greedy="greedy sampling trains nothing: every response of a prompt's group is "
                   "the same text with the same reward, so every advantage is 0; use a "
                   "temperature > 0 (1.0 is usual; greedy held-out evaluation is "
                   "loop.eval_temperature = 0)")
        check_range(f"{prefix}.top_p", self.top_p, 0, 1, lo_open=True)
        check_range(f"{prefix}.top_k", self.top_k, 0)
        check_range(f"{prefix}.max_new_tokens", self.max_new_tokens, 1)
        check_range(f"{prefix}.max_batch_size", self.max_batch_size, 1)
        check_choice(f"{prefix}.dtype", self.dtype, get_args(ParamDtypeKind))
        check_range(f"{prefix}.memory_fraction", self.memory_fraction, 0, 1)
        if self.routing_replay and self.engine not in ROUTING_ENGINES:
            raise ConfigError(
                f"config key '{prefix}.routing_replay' = true needs an engine that records "
                f"each token's experts; {prefix}.engine = {self.engine!r} does not (use "
                f"{' or '.join(map(repr, ROUTING_ENGINES))}, or set it to false)")
        if self.memory_fraction and self.engine not in POOLED_KV_ENGINES:
            raise ConfigError(
                f"config key '{prefix}.memory_fraction' = {self.memory_fraction} needs a paged "
                f"KV cache; {prefix}.engine = {self.engine!r} grows its cache with the batch "
                f"(set it to 0, or use {', '.join(map(repr, POOLED_KV_ENGINES))})")

    def engine_options(self, max_model_len: int) -> dict:
        """The inference engine's memory keyword arguments (every engine takes them):
        `max_model_len`, the run's longest sequence (data.max_prompt_tokens + max_new_tokens),
        bounds requests and, for vllm, the context and KV cache it starts with."""
        options = {"dtype": TORCH_DTYPE_NAMES[self.dtype], "max_model_len": max_model_len,
                   "memory_fraction": self.memory_fraction}
        if self.routing_replay:  # only then: an engine that cannot record never sees it
            options["record_routing"] = True
        return options


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """Low-rank adapters (peft) on `target_modules`; rank 0: off, every weight trains."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.rank", self.rank, 0)
        check_positive(f"{prefix}.alpha", self.alpha)
        check_range(f"{prefix}.dropout", self.dropout, 0, 1, hi_open=True)
        if self.enabled and not self.target_modules:
            raise ConfigError(f"config key '{prefix}.target_modules' is empty with "
                              f"{prefix}.rank = {self.rank}: name the modules to adapt")


MIN_COLLECTIVE_TIMEOUT_S = 10.0  # train.collective_timeout_s's lowest


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
    # the step's batch trained in this many parts, each as soon as its groups are collected,
    # while the rest still generate (verl's fully asynchronous trainer: require_batches
    # mini-batches a call, trigger_parameter_sync_step calls a weight sync); each part is
    # mini_batches / stream_chunks optimizer steps, so a step's optimizer steps stay the same
    # size and count. 1: the whole batch, once collected
    stream_chunks: int = 1
    # rows of one prompt share its forward pass: one packed sequence per prompt, its responses
    # after it (engines/training/packing.py); a pack holds at most max_packed_tokens tokens
    share_prompts: bool = True
    max_packed_tokens: int = 8192
    bucket_mb: int = 64  # weight-sync bucket size
    weight_channel: WeightChannelKind = "auto"  # auto: as the platforms agree; or force one (for tests)
    # how long a trainer rank waits in a collective (and the trainer group's forming) for the
    # others before it gives up: a rank alive but no longer taking part is then reported
    # lost. Short enough to matter (below cluster.timeout_s, the driver's deadline for the
    # whole call, which cannot tell which rank is stuck), long enough not to fire on a slow
    # step: the longest wait of one rank for another within a step, a checkpoint's write
    # included (docs/reliability.md, "Lost trainer ranks")
    collective_timeout_s: float = 300.0
    # --- memory (docs/engines.md, "Fitting the model"; `eddy plan` predicts their effect) ---
    # the compute dtype of the gathered weights: fp32, or bf16 / fp16 mixed precision (the
    # sharded master weights, gradient reduction and optimizer state stay fp32)
    param_dtype: ParamDtypeKind = "fp32"
    # recompute each decoder layer in the backward: none, full (keep only its input), or
    # selective (keep the attention kernel's output too: the rerun skips the attention, the
    # part that grows with the square of the sequence)
    activation_checkpointing: CheckpointingKind = "none"
    # log-probs through the LM head in chunks of this many tokens, never the whole
    # [tokens, vocab] fp32 tensor; 0: the whole micro-batch at once
    logprob_chunk_tokens: int = 1024
    # micro-batches formed by tokens: at most this many (padded) tokens each, micro_batch_size
    # rows still the upper bound; 0: by rows only
    max_tokens_per_micro_batch: int = 0
    # host memory: optimizer (AdamW's state between steps, on the device for the step only),
    # or all (FSDP2's CPU offload: weights, gradients, optimizer state; the step on the host)
    offload: OffloadKind = "none"
    # packed sequences: auto (variable-length attention where the platform has it, else the
    # dense block mask), mask, or varlen (refused where the platform has none)
    attention: AttentionKind = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)
    # after every RL step each rank's shard of the weights and optimizer state is
    # copied into the next rank's host memory, in the background (engines/training/buddy.py):
    # a lost rank is rebuilt from it bit for bit, without a checkpoint. Costs each rank twice
    # its shard's bytes of host memory; off: a lost rank ends the run
    buddy_replication: bool = True
    # what a lost trainer rank does to the run (docs/reliability.md, "Lost trainer ranks"):
    # replace (a new rank on the lost one's device, or any free one; the group shrinks to the
    # survivors when none starts), shrink (the survivors go on alone), stop (the run ends,
    # resumable from its last checkpoint). In place needs buddy_replication and 2+ ranks
    on_rank_loss: RankLossKind = "replace"

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
        check_range(f"{prefix}.stream_chunks", self.stream_chunks, 1)
        if self.mini_batches % self.stream_chunks:
            raise ConfigError(
                f"{prefix}.stream_chunks = {self.stream_chunks} does not divide "
                f"{prefix}.mini_batches = {self.mini_batches}: each part of the step is whole "
                "optimizer steps; set mini_batches to a multiple of stream_chunks")
        check_range(f"{prefix}.max_packed_tokens", self.max_packed_tokens, 1)
        check_range(f"{prefix}.bucket_mb", self.bucket_mb, 1)
        check_choice(f"{prefix}.weight_channel", self.weight_channel,
                     get_args(WeightChannelKind))
        # below this, a straggler's ordinary lead (a longer sequence, a garbage collection,
        # the first step's compilation) would end the run as a lost rank
        check_range(f"{prefix}.collective_timeout_s", self.collective_timeout_s,
                    MIN_COLLECTIVE_TIMEOUT_S)
        check_choice(f"{prefix}.on_rank_loss", self.on_rank_loss, get_args(RankLossKind))
        check_choice(f"{prefix}.param_dtype", self.param_dtype, get_args(ParamDtypeKind))
        check_choice(f"{prefix}.activation_checkpointing", self.activation_checkpointing,
                     get_args(CheckpointingKind))
        check_range(f"{prefix}.logprob_chunk_tokens", self.logprob_chunk_tokens, 0)
        check_range(f"{prefix}.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 0)
        check_choice(f"{prefix}.offload", self.offload, get_args(OffloadKind))
        check_choice(f"{prefix}.attention", self.attention, get_args(AttentionKind))
        self.lora.validate(f"{prefix}.lora")

    @property
    def mini_batches_per_call(self) -> int:
        """Optimizer steps in one training call: one part of a streamed step."""
        return self.mini_batches // self.stream_chunks

    def forward_options(self) -> dict:
        """What shapes a training forward pass, as keyword arguments of the training engine
        and of a joined replica: both must cut the same micro-batches the same way."""
        return {"micro_batch_size": self.micro_batch_size, "share_prompts": self.share_prompts,
                "max_packed_tokens": self.max_packed_tokens,
                "logprob_chunk_tokens": self.logprob_chunk_tokens,
                "max_tokens_per_micro_batch": self.max_tokens_per_micro_batch,
                "attention": self.attention}

    def engine_options(self) -> dict:
        """The training engine's keyword arguments from this section (optimizer aside)."""
        return {**self.forward_options(),
                "param_dtype": self.param_dtype,
                "activation_checkpointing": self.activation_checkpointing,
                "offload": self.offload, "lora": self.lora,
                "buddy_replication": self.buddy_replication}

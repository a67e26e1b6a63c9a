"""The memory plan of a run: what each role holds on each device, against the device's memory,
before anything starts (`eddy plan`, and the preflight of `eddy train`).

A plan needs no weights and no device: the model's shape (`shape_source`: config.json at
`model.path`, else the shipped shape `model.shape` names), the run's settings, and each
device's memory (`device_memory`: the HAL's query on this machine, or a datasheet entry by
name for a cluster that is not this machine). The trainer's bytes come from
`training_memory`, the rollout engine's from `rollout_memory`.

How roles share devices (`cluster.placement`): split, each role has devices of its own;
colocated, rollout worker i and trainer rank i take turns on one device (the trainer's state
goes to host memory while the engine generates, the engine sleeps while the trainer trains),
so the device's peak is the larger of the two; on a platform whose "device" is the host (no
Ray resource: the CPU), every process of the run shares the host's memory, so the peaks add.

How a role splits the model over devices (`Parallelism`): Eddy's own runs use one device per
rollout engine and per trainer rank; a cluster the plan speaks of for the simulator
(`plan/cluster.py`) may run wider rollout instances (tensor parallelism) and trainers whose
micro-batches are split over a group (Ulysses sequence parallelism) under an FSDP group of its
own size (HSDP).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .rollout_memory import RolloutOptions, rollout_memory
from .shapes import ModelShape, load_shape

if TYPE_CHECKING:
    from ..config import EddyConfig
    from ..hal import Platform

# Kept free on every device: the caching allocator's fragmentation and the device runtime's
# own context (CUDA / CANN context, collective buffers) are not in the terms.
RESERVE_FRACTION = 0.05
GIB = 2**30


@dataclass(frozen=True)
class DeviceMemory:
    name: str  # the device's name (a datasheet entry, or as the platform reports it)
    bytes: int
    source: str  # where the number comes from
    host: bool = False  # the host's memory, which every process of the run shares
    total: int = 0  # the host's whole memory (`bytes` is what is available now); else bytes

    @property
    def ceiling(self) -> int:
        """What no run can exceed: the device's memory, or the host's whole memory."""
        return max(self.total, self.bytes)


@dataclass(frozen=True)
class RolePlan:
    """One process of a role on its device: bytes by term, their peak, and what else to say
    (KV-cache tokens, concurrent sequences, bytes moved to host memory)."""

    role: str  # "train" | "rollout"
    terms: dict[str, int]
    peak: int
    details: dict[str, Any] = field(default_factory=dict)
    refused: str = ""  # why the process cannot start whatever its device's margin; "" if it can


@dataclass(frozen=True)
class DevicePlan:
    """`count` like devices, each holding `roles` (colocated: taking turns; host: all at once,
    `processes` of each role)."""

    label: str
    count: int
    memory: DeviceMemory
    roles: tuple[RolePlan, ...]
    sharing: str  # "own" (one role) | "turns" (colocated: the larger) | "shared" (the sum)
    processes: dict[str, int]  # processes of each role on one such device

    @property
    def peak(self) -> int:
        if self.sharing == "turns":
            return max(r.peak for r in self.roles)
        return sum(r.peak * self.processes[r.role] for r in self.roles)

    @property
    def reserve(self) -> int:
        return int(self.memory.bytes * RESERVE_FRACTION)

    @property
    def margin(self) -> int:
        """Bytes left under the device's memory at the predicted peak (negative: over it)."""
        return self.memory.bytes - self.peak

    @property
    def fits(self) -> bool:
        return self.margin >= self.reserve and not any(r.refused for r in self.roles)


@dataclass(frozen=True)
class Parallelism:
    """How each role splits the model over devices (module docstring); the default is Eddy's
    own: one device per rollout engine and per trainer rank, FSDP over all the ranks."""

    rollout: tuple[tuple[int, int], ...] = ()  # (tensor parallel, instances); (): one each
    train_sp: int = 1  # Ulysses sequence parallel degree of the trainer
    train_shard: int = 0  # FSDP group in devices (verl's fsdp_size); 0: every trainer rank

    def rollout_widths(self, config: EddyConfig) -> tuple[tuple[int, int], ...]:
        return self.rollout or ((1, config.rollout.num_workers),)


@dataclass(frozen=True)
class Fix:
    """One setting changed (on top of the fixes before it) and the role's peak after it."""

    override: str  # key=value, as the command line takes it
    why: str
    role: str  # the role it concerns
    peak: int  # the largest peak of one process of that role, after this fix
    fits: bool  # the whole plan, after this fix


@dataclass(frozen=True)
class MemoryPlan:
    model: str  # where the shape came from
    parameters: int
    devices: tuple[DevicePlan, ...]
    fixes: tuple[Fix, ...] = ()

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)


# ---- inputs ------------------------------------------------------------------------------
def shape_source(config: EddyConfig) -> Path:
    """The config.json the plan reads: `model.path`'s when it is on this machine, else the
    one `model.shape` names; a ConfigError saying both when neither is there."""
    from ..models.config import ASSETS, BUILTIN_PREFIX, shape_file

    path = config.model.path
    directory = ASSETS / path[len(BUILTIN_PREFIX):] if path.startswith(BUILTIN_PREFIX) \
        else Path(path).expanduser()
    if (directory / "config.json").is_file():
        return directory / "config.json"
    if config.model.shape is not None:
        return shape_file(config.model.shape)
    raise ConfigError(f"config key 'model.path' = {path!r} has no config.json here and "
                      "'model.shape' is not set: the memory plan needs the model's shape; set "
                      "model.shape to a shipped shape (eddyrl/assets/shapes) or a config.json")


def device_memory(platform: Platform, device: str | None) -> DeviceMemory:
    """`device`: a datasheet entry's name (`scheduler/hardware.py`), for a cluster that is not
    this machine; None: `platform`'s device 0 on this machine (the CPU: the host's memory
    available now)."""
    if device is not None:
        from ..scheduler.hardware import lookup_accelerator

        try:
            entry = lookup_accelerator(device)
        except ConfigError as exc:
            raise ConfigError(f"--device {device!r}: {str(exc).split(' is not allowed; ')[-1]}") \
                from None
        return DeviceMemory(entry.name, int(entry.hbm_bytes),
                            "datasheet (scheduler/hardware.py)")
    reason = platform.check_usable()
    if reason is not None:
        raise ConfigError(f"platform {platform.name!r} is not usable here ({reason}), so its "
                          "devices' memory is unknown; plan for a device by name with --device "
                          "NAME (e.g. H100, A800, H200, H20, 910B)")
    name = platform.properties(0).name
    if platform.ray_resource is None:
        return DeviceMemory(name, platform.device_memory_bytes(0), "host memory available now",
                            host=True, total=platform.properties(0).total_memory)
    return DeviceMemory(name, platform.device_memory_bytes(0), f"platform {platform.name}")


# ---- the roles ---------------------------------------------------------------------------
def longest_sequence(config: EddyConfig) -> int:
    return config.longest_sequence()


def training_options(config: EddyConfig, attention: str, foreach: bool = True,
                     parallel: Parallelism = Parallelism()) -> Any:
    """The trainer's `TrainingOptions` from the config: the largest micro-batch is
    `micro_batch_size` rows of the longest sequence, or the token budget when one is set (a
    row longer than the budget still goes alone); gradients accumulate when a data-parallel
    group's share of an optimizer step is more rows than one micro-batch. `foreach`: the
    optimizer's foreach implementation (torch's default on accelerators; the host runs it per
    tensor). Under `parallel.train_sp` a micro-batch and its budget are a group's, its tokens
    split over the group's devices."""
    from .training_memory import TrainingOptions

    train, longest = config.train, longest_sequence(config)
    sp = parallel.train_sp
    if train.num_workers % sp:
        raise ConfigError(f"train.num_workers = {train.num_workers} is not a multiple of the "
                          f"sequence-parallel degree {sp}")
    rows, tokens = train.micro_batch_size, train.micro_batch_size * longest
    if train.max_tokens_per_micro_batch:
        tokens = max(longest, min(train.max_tokens_per_micro_batch, tokens))
        rows = max(1, min(rows, tokens // longest))
    step_rows = config.loop.batch_prompts * config.rollout.n_samples / (
        train.mini_batches * (train.num_workers // sp))
    return TrainingOptions(
        gradient_accumulation=step_rows > rows, foreach_optimizer=foreach,
        lora_dropout=bool(train.lora.rank and train.lora.dropout > 0),
        world_size=parallel.train_shard or train.num_workers, sequence_parallel=sp,
        param_dtype=train.param_dtype,
        buddy_replication=train.buddy_replication,
        tokens_per_micro_batch=tokens, rows_per_micro_batch=rows,
        activation_checkpointing=train.activation_checkpointing,
        logprob_chunk_tokens=train.logprob_chunk_tokens, offload=train.offload,
        attention=attention, lora_rank=train.lora.rank,
        lora_targets=tuple(train.lora.target_modules) if train.lora.rank else ())


def attention_kind(config: EddyConfig, platform: Platform | None) -> str:
    """`train.attention` as the memory model names it: `auto` is variable-length attention
    where the training platform, asked on this machine, has it in the run's dtype; planned for
    another machine (or a platform without the query), the dense mask: the larger of the two."""
    chosen = config.train.attention
    if chosen != "auto":
        return chosen
    if platform is None or getattr(platform, "varlen_attention", None) is None \
            or platform.check_usable() is not None:
        return "mask"
    import torch

    from ..engines.training.attention import attention_layout

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        config.train.param_dtype]
    try:  # the engine's own rule (engines/training/attention.py)
        return attention_layout(chosen, platform, dtype)
    except Exception:  # a half-installed kernel library: plan the mask
        return "mask"


def train_role(config: EddyConfig, shape: ModelShape, attention: str,
               on_host: bool = False, parallel: Parallelism = Parallelism()) -> RolePlan:
    """`on_host`: the trainer's device is the host itself (the CPU platform), where the
    accelerators' optimizer runs per tensor and what offload moves stays in the same memory."""
    from .training_memory import training_memory

    options = training_options(config, attention, foreach=not on_host, parallel=parallel)
    memory = training_memory(shape, options)
    terms = {k: v for k, v in memory.as_dict().items()
             if isinstance(v, int) and k not in ("host", "buddy", "peak")}
    peak = int(memory.peak)
    if on_host:  # the host memory is this trainer's device
        for term, size in (("offloaded", memory.host - memory.buddy),
                           ("buddy copies", memory.buddy)):
            if size:
                terms[term] = int(size)
        peak += int(memory.host)
    return RolePlan("train", terms, peak,
                    {"tokens_per_micro_batch": options.tokens_per_micro_batch,
                     "rows_per_micro_batch": options.rows_per_micro_batch,
                     "sequence_parallel": options.sequence_parallel,
                     "fsdp_group": options.world_size,
                     "host_bytes": int(memory.host), "buddy_bytes": int(memory.buddy),
                     "attention": attention,
                     "moment": getattr(memory, "moment", "")})


def rollout_role(config: EddyConfig, shape: ModelShape, model_config: dict,
                 memory: DeviceMemory, tensor_parallel: int = 1) -> RolePlan:
    """The engine as the runtime starts it (`EddyConfig.rollout_engine_options`): in
    `rollout.dtype`, with the run's longest sequence as its context (within the model's
    positions), its KV cache sized exactly or as `rollout.memory_fraction` of `memory`; one
    device of a `tensor_parallel`-wide instance."""
    rollout, longest = config.rollout, longest_sequence(config)
    options = RolloutOptions(
        engine=rollout.engine, max_batch_size=rollout.max_batch_size, longest=longest,
        prompt_tokens=config.data.max_prompt_tokens,
        max_model_len=min(longest, int(model_config.get("max_position_embeddings") or longest)),
        dtype=rollout.dtype, memory_fraction=rollout.memory_fraction,
        device_bytes=memory.ceiling, tensor_parallel=tensor_parallel)
    planned = rollout_memory(shape, options)
    refused = ""
    if planned.short:
        refused = (f"rollout.memory_fraction = {rollout.memory_fraction} of "
                   f"{memory.ceiling / GIB:.2f} GiB leaves vLLM less than one sequence of "
                   f"{options.max_model_len} tokens after its weights and workspace "
                   f"({planned.short / GIB:.2f} GiB short): it refuses to start")
    return RolePlan("rollout", planned.terms(), planned.peak,
                    {"kv_tokens": planned.kv_tokens,
                     "concurrent_sequences": planned.concurrent_sequences,
                     "longest": options.longest, "max_batch_size": options.max_batch_size,
                     "max_model_len": options.max_model_len, "engine": options.engine,
                     "tensor_parallel": tensor_parallel,
                     "dtype": options.dtype, "memory_fraction": options.memory_fraction},
                    refused)


# ---- the plan ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanInputs:
    """What does not change while fixes are tried: the shape and each role's device."""

    source: Path
    shape: ModelShape
    model_config: dict
    memories: dict[str, DeviceMemory]
    platforms: dict[str, Any]
    parallel: Parallelism = Parallelism()


def plan_inputs(config: EddyConfig, device: str | None = None) -> PlanInputs:
    from ..hal import get_platform
    from ..runtime.placement import role_platform_name

    source = shape_source(config)
    model_config = json.loads(source.read_text())
    platforms, memories = {}, {}
    for role in ("train", "rollout"):
        platforms[role] = get_platform(role_platform_name(config, role), require_available=False)
        memories[role] = device_memory(platforms[role], device)
    return PlanInputs(source, load_shape(source), model_config, memories, platforms)


def _devices(config: EddyConfig, inputs: PlanInputs) -> tuple[DevicePlan, ...]:
    parallel = inputs.parallel
    train = train_role(config, inputs.shape, attention_kind(config, inputs.platforms["train"]),
                       on_host=inputs.memories["train"].host, parallel=parallel)
    widths = parallel.rollout_widths(config)
    rollouts = [(tp, instances, rollout_role(config, inputs.shape, inputs.model_config,
                                             inputs.memories["rollout"], tensor_parallel=tp))
                for tp, instances in widths]
    rollout = max((r for _, _, r in rollouts), key=lambda r: r.peak)
    counts = {"train": config.train.num_workers, "rollout": config.rollout.num_workers}
    if inputs.memories["train"].host and inputs.memories["rollout"].host:
        return (DevicePlan("host (every process)", 1, inputs.memories["train"],
                           (train, rollout), "shared", counts),)
    if config.cluster.placement == "colocated":  # the widest-holding instance on every device
        return (DevicePlan("train + rollout (colocated)", counts["train"],
                           inputs.memories["train"], (train, rollout), "turns",
                           {"train": 1, "rollout": 1}),)
    label = "rollout" if widths == ((1, counts["rollout"]),) else None
    return (DevicePlan("train", counts["train"], inputs.memories["train"], (train,), "own",
                       {"train": 1}),
            *(DevicePlan(label or f"rollout (tp {tp})", tp * instances,
                         inputs.memories["rollout"], (plan,), "own", {"rollout": 1})
              for tp, instances, plan in rollouts))


def plan_memory(config: EddyConfig, device: str | None = None,
                inputs: PlanInputs | None = None) -> MemoryPlan:
    """The plan of `config` (with `device`, a datasheet entry's name, for every role's
    devices), and when it does not fit, the cheapest fixes in order (`fixes.py`)."""
    from .fixes import find_fixes

    inputs = inputs or plan_inputs(config, device)
    devices = _devices(config, inputs)
    plan = MemoryPlan(str(inputs.source), inputs.shape.parameters(), devices)
    if plan.fits:
        return plan
    return MemoryPlan(plan.model, plan.parameters, devices,
                      tuple(find_fixes(config, lambda c: _devices(c, inputs))))


def with_setting(config: EddyConfig, key: str, value: Any) -> EddyConfig:
    """A copy of `config` with dotted `key` set to `value`."""
    changed = copy.deepcopy(config)
    *sections, leaf = key.split(".")
    node = changed
    for section in sections:
        node = getattr(node, section)
    setattr(node, leaf, value)
    return changed

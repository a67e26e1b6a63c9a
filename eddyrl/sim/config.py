"""The `sim` section of the config: the simulated cluster (devices, model, parallelism) and
workload. The RL settings of a simulated run are the usual sections (loop, algorithm, rollout,
replay, routing, elastic, adaptive): the simulator runs the same controller on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence, get_args

from ..config import EddyConfig, load_config
from .workload import WorkloadConfig
from ..validation import check_range, contradiction


WeightLink = Literal["inter_node", "intra_node", "host"]
SimMigration = Literal["recompute", "carry_kv"]
# whose definition of the in-flight bound the asynchronous policies run (`partial`: eddy's or
# verl's; `async`: eddy's or AReaL's): eddyrl/sim/policies.py, docs/simulator.md
Reproduces = Literal["eddy", "verl", "areal"]


@dataclass(kw_only=True, slots=True)
class SimRoleConfig:
    accelerator: str = "H100"  # a cost-model table name (scheduler/hardware.py)
    devices: int = 8
    tp: int = 1  # devices per engine instance (rollout) or per data-parallel group (train)
    max_batch_size: int = 256  # rollout only: sequences one instance decodes together
    # train only: devices the FSDP shard group spans (verl's fsdp_size); 0: all of them
    fsdp_size: int = 0
    # train only: the old log-probs come from the rollout engine (verl's fully asynchronous
    # use_rollout_log_probs), so the trainer runs no pre-update log-prob pass
    rollout_logprobs: bool = False

    def validate(self, prefix: str) -> None:
        from ..scheduler.hardware import lookup_accelerator

        lookup_accelerator(self.accelerator)
        check_range(f"{prefix}.devices", self.devices, 1)
        check_range(f"{prefix}.tp", self.tp, 1)
        check_range(f"{prefix}.max_batch_size", self.max_batch_size, 1)
        if self.devices % self.tp:
            raise contradiction(f"{prefix}.devices = {self.devices} is not a multiple of "
                                f"{prefix}.tp = {self.tp}")
        check_range(f"{prefix}.fsdp_size", self.fsdp_size, 0)
        if self.fsdp_size and self.devices % self.fsdp_size:
            raise contradiction(f"{prefix}.devices = {self.devices} is not a multiple of "
                                f"{prefix}.fsdp_size = {self.fsdp_size}")

    @property
    def groups(self) -> int:
        return self.devices // self.tp


@dataclass(kw_only=True, slots=True)
class SimEfficiency:
    """Overrides of scheduler/cost_model.py `Efficiency` (each in (0, 1])."""

    prefill_mfu: float | None = None
    decode_bandwidth_efficiency: float | None = None
    train_mfu: float | None = None
    comm_efficiency: float | None = None


@dataclass(kw_only=True, slots=True)
class SimConfig:
    model: str = "Qwen3-4B"  # a cost-model table name
    rollout: SimRoleConfig = field(default_factory=SimRoleConfig)
    train: SimRoleConfig = field(default_factory=SimRoleConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    # weights cross to rollout over the NIC (inter_node), NVLink/HCCS (intra_node), or through
    # host memory when the two roles are different vendors' devices (host: PCIe both ways)
    weight_link: WeightLink = "inter_node"
    host_link_bandwidth: float = 25e9  # B/s per device, for weight_link = host
    # elastic pool: a worker changing role pays a cold start each way: this fixed set-up
    # (memory release, process group, allocator warm-up) plus loading its weight shard
    move_setup_s: float = 10.0
    # a migrated request's KV cache: recomputed on the target (what every engine here does),
    # or carried over the network (DORA's instances of one version exchange caches)
    migration: SimMigration = "recompute"
    # the cost model's efficiency factors where a scenario is calibrated (None: the default)
    efficiency: SimEfficiency = field(default_factory=lambda: SimEfficiency())
    # the system whose in-flight bound the asynchronous policies reproduce (sim/policies.py):
    # "eddy": `partial` bounds the groups generating at once to (1 + staleness_threshold)
    # batches; "verl": `partial` bounds, as verl's fully asynchronous trainer does, the groups
    # started per weight sync to that many (those carried over counted) and the groups
    # generating to 16 per rollout server; "areal": `async` takes the scenario's own K
    # (max_head_offpolicyness) and window.max_inflight_prompts (max_concurrent_rollouts)
    reproduces: Reproduces = "eddy"
    # how far the rollout runs ahead, in batches (verl's async_training.staleness_threshold)
    staleness_threshold: float = 0.5

    def validate(self, prefix: str) -> None:
        from ..scheduler.hardware import lookup_model
        from ..validation import check_choice

        lookup_model(self.model)
        self.rollout.validate(f"{prefix}.rollout")
        self.train.validate(f"{prefix}.train")
        self.workload.validate(f"{prefix}.workload")
        check_choice(f"{prefix}.weight_link", self.weight_link, get_args(WeightLink))
        check_range(f"{prefix}.host_link_bandwidth", self.host_link_bandwidth, 0, lo_open=True)
        check_range(f"{prefix}.move_setup_s", self.move_setup_s, 0)
        check_choice(f"{prefix}.migration", self.migration, get_args(SimMigration))
        check_choice(f"{prefix}.reproduces", self.reproduces, get_args(Reproduces))
        check_range(f"{prefix}.staleness_threshold", self.staleness_threshold, 0)
        self.efficiency_factors()  # out-of-range values are named

    def efficiency_factors(self):
        """The Efficiency the simulated devices run at, or None for the model's defaults."""
        from dataclasses import fields, replace

        from ..scheduler.cost_model import Efficiency

        chosen = {f.name: getattr(self.efficiency, f.name) for f in fields(self.efficiency)
                  if getattr(self.efficiency, f.name) is not None}
        for name, value in chosen.items():
            check_range(f"sim.efficiency.{name}", value, 0, 1, lo_open=True)
        return replace(Efficiency(), **chosen) if chosen else None


@dataclass(kw_only=True, slots=True)
class SimRunConfig(EddyConfig):
    """A simulated run's config: a real run's, plus the simulated cluster (`sim`). Only `eddy
    sim` and `eddy bench sim` read this section, so only they accept it; the config package
    knows nothing of the simulator."""

    sim: SimConfig = field(default_factory=SimConfig)


def load_scenario(path: str | Path | None = None, overrides: Sequence[str] = ()
                  ) -> SimRunConfig:
    """A scenario file, or a bundled scenario's name (`dora_64` or `sim/dora_64`), with
    overrides, as `config.load_config` loads a real run's."""
    return load_config(path, overrides, schema=SimRunConfig, folder="sim")

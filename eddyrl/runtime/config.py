"""Where workers run: the Ray cluster section of the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import ConfigError
from ..validation import check_choice, check_range


Placement = Literal["split", "colocated"]
# How a role's actors spread over a cluster's nodes (Ray placement-group strategies); "any":
# no group, Ray's own scheduling (one machine needs nothing more).
Strategy = Literal["any", "pack", "spread", "strict_pack", "strict_spread"]
RuntimeKind = Literal["auto", "ray", "local"]


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    # None: start Ray on this machine, bound to loopback. "auto" or "host:port": join a cluster.
    address: str | None = None
    num_cpus: int | None = None  # CPUs Ray may use when it starts locally (None: all)
    threads_per_worker: int = 0  # host threads per worker process (0: all cores)
    timeout_s: float = 600.0  # longest wait for any worker call or collective before an error
    # split: rollout workers and trainer ranks on their own devices (what asynchronous
    # training needs: both roles busy at once). colocated: rollout worker i and trainer rank i
    # share one device and take turns (verl's hybrid engine): the engine sleeps while the
    # trainer trains, the trainer's state waits in host memory while the engine generates.
    # Synchronous only; it lets one device run `eddy train`.
    placement: Placement = "split"
    # ray: every worker an actor of a Ray cluster (local on loopback unless `address`).
    # local: one process, no Ray: the rollout engines and one trainer rank in the driver
    # (runtime/local.py); no elastic pool, worker replacement or colocation.
    # auto: local when the job fits one process (`EddyConfig.runtime_kind`), else ray.
    runtime: RuntimeKind = "auto"
    # On a cluster (`address` set): whether every node sees the same files at these paths.
    # shared_model: actors read model.path where it is; else the driver ships the model's
    # files through Ray's object store, written once per node into a node-local cache.
    shared_model: bool = False
    # shared_run_dir: trainer ranks write checkpoints into run_dir themselves; else each rank
    # saves on its node's own disk and the driver writes the files it collects from them.
    shared_run_dir: bool = False
    # Over a cluster's nodes: trainer ranks packed (the data-parallel group on the fewest
    # nodes: fast links) or spread; rollout workers likewise. With colocated placement each
    # bundle already holds a pair (rollout worker i, trainer rank i): train_strategy places
    # the bundles.
    train_strategy: Strategy = "any"
    rollout_strategy: Strategy = "any"

    def validate(self, prefix: str) -> None:
        if self.num_cpus is not None:
            check_range(f"{prefix}.num_cpus", self.num_cpus, 1)
        check_range(f"{prefix}.threads_per_worker", self.threads_per_worker, 0)
        check_range(f"{prefix}.timeout_s", self.timeout_s, 0, lo_open=True)
        check_choice(f"{prefix}.placement", self.placement, get_args(Placement))
        check_choice(f"{prefix}.runtime", self.runtime, get_args(RuntimeKind))
        for key in ("train_strategy", "rollout_strategy"):
            check_choice(f"{prefix}.{key}", getattr(self, key), get_args(Strategy))
        if self.placement == "colocated" and self.rollout_strategy != "any":
            raise ConfigError(f"{prefix}.placement = colocated keeps rollout worker i with "
                              f"trainer rank i: {prefix}.rollout_strategy = "
                              f"{self.rollout_strategy} cannot place them apart; set "
                              f"{prefix}.train_strategy for both")
        if self.address is not None and self.address != "auto":
            from .ray.connect import split_address

            split_address(self.address)  # host:port, or an error naming the value
        if self.runtime == "local" and self.address is not None:
            raise ConfigError(f"{prefix}.runtime = local runs in this process; "
                              f"{prefix}.address = {self.address!r} joins a Ray cluster: "
                              f"set {prefix}.runtime = ray")

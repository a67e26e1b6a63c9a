"""The cluster simulator's runtime: simulated engines on a virtual clock, driven by the same
`Controller` (and with it the version window, store, assignment, replay, router, adaptive
scheduler) that drives Ray workers in a real run.

`SimRuntime` is the runtime protocol over `SimInferenceEngine`s and a `SimTrainer`: generation,
training and weight sync take the cost model's time on the loop's clock, which
`clock.VirtualTimeLoop` advances from event to event. `simulate(config)` builds a run
from the config's `sim` section (cluster, model, workload) and its usual RL sections, runs it
and returns the controller's summary with the simulator's accounting (busy time per role, the
control plane's CPU time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..build import build_controller, loop_settings
from ..core.controller import Controller
from ..core.rewarding import SafeReward
from ..errors import ConfigError
from ..protocol import GenerationRequest, SamplingParams
from .engine import SimInferenceEngine
from .trainer import SimBatch, SimTrainer, build_sim_batch
from ..observability.trace import Trace as Timeline  # the worker timeline real runs write too
from ..scheduler.buckets import worker_batch_size
from ..scheduler.cost_model import VLLM_MAX_NUM_BATCHED_TOKENS, CostModel
from ..scheduler.rollout_cost import WeightUpdate, staged_load_seconds
from . import workload as synthetic
from .clock import run_virtual

if TYPE_CHECKING:
    from ..config import EddyConfig


@dataclasses.dataclass(frozen=True, slots=True)
class Devices:
    """Where the simulated roles run: each rollout instance's devices, the trainer's, and
    whether the two share them (colocated: they take turns, paying `switch_s` each way)."""

    instance_tps: tuple[int, ...]
    train: int
    colocated: bool = False
    # colocated: seconds a device spends handing itself over (to training: the engine's weights
    # to host memory, the trainer's state back; to rollout: the reverse)
    switch_s: float = 0.0

    @property
    def total(self) -> int:
        return self.train if self.colocated else self.train + sum(self.instance_tps)


class SimRuntime:
    workers: list[SimInferenceEngine]

    def __init__(self, engines: list[SimInferenceEngine], trainer: SimTrainer,
                 weight_sync_s: float, timeline: Timeline | None = None, *,
                 move_s: float = 0.0, replica_groups: float = 1.0,
                 devices: Devices | None = None, pause_to_receive: bool = False) -> None:
        """`move_s`: a worker's cold start when it changes role; `replica_groups`: data-parallel
        groups a rollout worker adds to training when it joins (its devices / the trainer's tp);
        `devices`: the layout, for device-level idle time and colocated turn-taking (default:
        split, one device per instance and per trainer group); `pause_to_receive`: engines stop
        decoding while the weights cross (verl), instead of staging them meanwhile (Eddy)."""
        self.workers = engines
        self.trainer = trainer
        self.weight_sync_s = weight_sync_s
        self.pause_to_receive = pause_to_receive
        self.devices = devices or Devices((1,) * len(engines), trainer.dp)
        self._trace_train = timeline.recorder("train", 0) if timeline is not None else None
        self._trace_roles = [timeline.recorder("rollout", i) for i in range(len(engines))] \
            if timeline is not None else None
        self._joined_at: dict[int, float] = {}
        self.move_s = move_s
        self.replica_groups = replica_groups
        self.replicas: dict[int, int] = {}  # joined worker -> its weights' version (-1: none)
        self.train_busy_s = 0.0
        self.sync_busy_s = 0.0
        self.switch_busy_s = 0.0
        # (time, rollout busy s, train busy s, busy device-seconds) at the end of every step:
        # idle over any span
        self.marks: list[tuple[float, float, float, float]] = []

    def _record(self, name: str, seconds: float, args: dict) -> None:
        if self._trace_train is not None:
            self._trace_train(name, self.now(), seconds, args)

    def _record_role(self, worker: int, name: str, seconds: float,
                     at: float | None = None) -> None:
        if self._trace_roles is not None:
            self._trace_roles[worker](name, self.now() if at is None else at, seconds,
                                      {"worker": worker})

    def close_roles(self, end_s: float) -> None:
        """Trace the replica time of workers still lent to training when the run ended."""
        for worker, joined in self._joined_at.items():
            self._record_role(worker, "replica", end_s - joined, at=joined)

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def generate(self, worker: int, requests: list[GenerationRequest]):
        return self.workers[worker].generate(requests)

    async def abort(self, worker: int, request_ids: list[str]) -> None:
        await self.workers[worker].abort(request_ids)

    async def train(self, batch: SimBatch, replicas: Sequence[int] = ()
                    ) -> dict[str, float]:
        if self.devices.colocated:
            await self._hand_devices_to("train")
        cost = self.trainer.step_cost(batch, extra_dp=len(replicas) * self.replica_groups)
        seconds = cost.total_s
        self.train_busy_s += seconds
        self._record("train", seconds, {"rows": batch.rows, "tokens": batch.tokens})
        await asyncio.sleep(seconds)
        # the step's parts (compute, imbalance, collectives, optimizer, log-prob passes)
        return {"train_tokens": float(batch.tokens), "replicas_joined": len(replicas),
                **cost.as_dict()}

    async def sync_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        """One broadcast to every instance at once (each receives its shards over its own
        link, into a staging copy, while it goes on decoding, as Eddy's `vllm` engine does),
        then each stages or applies the new version (those in `hold` stage it); applying is the
        engine's pause (load, prefix-cache reset, chunked re-prefill: engine.py)."""
        if self.devices.colocated:
            await self._hand_devices_to("rollout")
        self.sync_busy_s += self.weight_sync_s
        self._record("weight sync", self.weight_sync_s, {"version": version})
        if self.pause_to_receive:
            for index, engine in enumerate(self.workers):
                if index not in self.replicas:
                    await engine.pause_for(self.weight_sync_s)
        await asyncio.sleep(self.weight_sync_s)
        loads = []
        for index, engine in enumerate(self.workers):
            if index in self.replicas:
                self.replicas[index] = version  # a joined replica fetches its state here
            else:
                loads.append(engine.load_weights(version, hold=index in hold))
        await asyncio.gather(*loads)  # idle engines load in parallel; busy ones at their step
        self.marks.append((self.now(), sum(e.stats().busy_seconds for e in self.workers),
                           self.train_busy_s, self.device_busy_s()))
        return [engine.version for engine in self.workers]

    async def _hand_devices_to(self, role: str) -> None:
        """Colocated turn-taking: to train, every engine finishes its work and sleeps (KV cache
        freed, weights to host) while the trainer's state comes back; to rollout, the reverse
        (the engines wake before the weight sync reaches them)."""
        if role == "train":
            for engine in self.workers:
                await engine.wait_idle()
            for engine in self.workers:
                await engine.sleep()
        self.switch_busy_s += self.devices.switch_s
        self._record(f"switch to {role}", self.devices.switch_s, {})
        await asyncio.sleep(self.devices.switch_s)
        if role == "rollout":
            for engine in self.workers:
                await engine.wake()

    def device_busy_s(self) -> float:
        """Device-seconds spent on work so far: generating (each instance's busy time times its
        devices), training, weight sync and role switches (every device of the roles they
        occupy)."""
        rollout = sum(e.stats().busy_seconds * tp
                      for e, tp in zip(self.workers, self.devices.instance_tps))
        # the sync holds the trainer's devices (split rollout instances may go on generating)
        return (rollout + self.train_busy_s * self.devices.train
                + self.sync_busy_s * self.devices.train
                + self.switch_busy_s * self.devices.total)

    def idle_between(self, first: int, last: int) -> tuple[float, float, float]:
        """(rollout, train, device) idle fractions from the end of step `first` to the end of
        step `last` (1-based); device idle is over every device of the cluster."""
        (t0, r0, w0, d0), (t1, r1, w1, d1) = self.marks[first - 1], self.marks[last - 1]
        span = max(t1 - t0, 1e-12)
        return (1 - (r1 - r0) / (span * len(self.workers)), 1 - (w1 - w0) / span,
                1 - (d1 - d0) / (span * self.devices.total))

    async def worker_stats(self) -> list[Any]:
        return [engine.stats() for engine in self.workers]

    # ---- the elastic pool: a rollout worker lent to training and given back -------------------
    async def join_training(self, worker: int) -> None:
        engine = self.workers[worker]
        await engine.wait_idle()  # evacuated requests leave at the engine's next step
        await engine.sleep()
        self._record_role(worker, "join", self.move_s)
        await asyncio.sleep(self.move_s)  # memory released, replica built
        self.replicas[worker] = -1  # weights come with the next sync
        self._joined_at[worker] = self.now()

    async def replica_version(self, worker: int) -> int:
        return self.replicas.get(worker, -1)

    async def leave_training(self, worker: int) -> int:
        version = self.replicas.pop(worker, -1)
        engine = self.workers[worker]
        joined = self._joined_at.pop(worker, self.now())
        self._record_role(worker, "replica", self.now() - joined, at=joined)
        self._record_role(worker, "leave", self.move_s)
        await asyncio.sleep(self.move_s)  # replica freed, engine woken, weights loaded
        await engine.wake()
        if version > engine.version:
            await engine.load_weights(version)
        return engine.version

    async def configure_rollout(self, max_batch_size: int, partial_rollout: bool) -> list[int]:
        for engine in self.workers:
            engine.configure(max_batch_size=max_batch_size, partial_rollout=partial_rollout)
        return [engine.version for engine in self.workers]


# Mixed-precision Adam keeps, per parameter, bf16 weights and gradients (2 + 2 bytes) and fp32
# master weights and two moments (4 + 4 + 4): what a colocated trainer parks in host memory.
TRAIN_STATE_BYTES_PER_PARAM = 16


def check_colocated(config: EddyConfig) -> None:
    """Colocated roles share devices: the scenario gives both roles the same ones."""
    sim = config.sim
    if config.cluster.placement != "colocated":
        return
    if (sim.rollout.devices, sim.rollout.accelerator) != (sim.train.devices,
                                                          sim.train.accelerator):
        raise ConfigError(
            "cluster.placement = colocated shares devices between the roles, but "
            f"sim.rollout has {sim.rollout.devices} x {sim.rollout.accelerator} and sim.train "
            f"{sim.train.devices} x {sim.train.accelerator}; give both the same devices")


def switch_seconds(config: EddyConfig, rollout_cost: CostModel) -> float:
    """A colocated device handing itself from one role to the other, over its host link: the
    engine's weight shard one way, the trainer's sharded state (weights, gradients, optimizer)
    the other. The freed KV cache costs nothing to drop; re-allocating it is not modelled."""
    sim = config.sim
    engine_shard = rollout_cost.weights_bytes / sim.rollout.tp
    train_state = rollout_cost.model.total_params * TRAIN_STATE_BYTES_PER_PARAM / \
        sim.train.devices
    return (engine_shard + train_state) / sim.host_link_bandwidth


def weight_sync_seconds(config: EddyConfig, rollout_cost: CostModel,
                        train_cost: CostModel) -> float:
    """Trainer -> rollout: each rollout device receives its tp shard. Over the NIC or NVLink
    at the slower end's bandwidth; through host memory (different vendors, or colocated roles
    on one device, which a collective cannot connect to itself) it is copied device -> host
    here, one hop over PCIe; the hop back to the device is the engine's load
    (`weight_update`), which pauses it."""
    sim = config.sim
    shard = rollout_cost.weights_bytes / sim.rollout.tp
    if sim.weight_link == "host" or config.cluster.placement == "colocated":
        return rollout_cost.weight_sync_seconds(shard, sim.host_link_bandwidth)
    pick = (lambda a: a.inter_node_bandwidth) if sim.weight_link == "inter_node" else \
        (lambda a: a.intra_node_bandwidth)
    bandwidth = min(pick(rollout_cost.accelerator), pick(train_cost.accelerator))
    return rollout_cost.weight_sync_seconds(shard, bandwidth)


def weight_update(config: EddyConfig, cost: CostModel) -> WeightUpdate:
    """How an instance of `cost`'s tp takes new weights: staged through host memory (weight_link
    host, or colocated roles, whose sync goes through the host) or in device buffers (a
    collective over NVLink / the NIC), then copied into place; vLLM's default token budget for
    the re-prefill."""
    from_host = (config.sim.weight_link == "host"
                 or config.cluster.placement == "colocated")
    return WeightUpdate(load_s=staged_load_seconds(cost, from_host,
                                                   config.sim.host_link_bandwidth),
                        token_budget=VLLM_MAX_NUM_BATCHED_TOKENS)


def instance_tps(config: EddyConfig) -> list[int]:
    """Each rollout instance's tensor-parallel degree: `sim.rollout.tp`, or with a router its
    bucket's `parallelism` where set (Libra's wider instances for long requests); the
    instances must use exactly `sim.rollout.devices`."""
    sim, routing = config.sim, config.routing
    if routing.policy == "none":
        return [sim.rollout.tp] * sim.rollout.groups
    tps = [spec.parallelism or sim.rollout.tp
           for spec in routing.buckets for _ in range(spec.workers)]
    if sum(tps) != sim.rollout.devices:
        raise ConfigError(
            f"routing.buckets use {sum(tps)} rollout devices ("
            + ", ".join(f"{b.name}: {b.workers} x tp {b.parallelism or sim.rollout.tp}"
                        for b in routing.buckets)
            + f") but sim.rollout.devices = {sim.rollout.devices}; make them add up")
    return tps


def scenario_trainer(config: EddyConfig, cost: CostModel | None = None) -> SimTrainer:
    """The simulated trainer of `config`'s scenario, as `build` makes it: its groups, FSDP
    shard and log-prob passes (`cost`: the training side's, made here when not given)."""
    sim = config.sim
    if cost is None:
        cost = CostModel(sim.train.accelerator, sim.model, sim.efficiency_factors(),
                         tp=sim.train.tp)
    return SimTrainer.from_config(config, cost, sim.train.groups, shard=sim.train.fsdp_size,
                                  rollout_logprobs=sim.train.rollout_logprobs)


def build(config: EddyConfig, log: Callable[[dict[str, Any]], None] = lambda m: None,
          timeline: Timeline | None = None) -> tuple[Controller, SimRuntime]:
    """The controller and runtime of a simulated run of `config`."""
    sim = config.sim
    check_colocated(config)
    tps = instance_tps(config)
    config = dataclasses.replace(config, rollout=dataclasses.replace(
        config.rollout, num_workers=len(tps), max_batch_size=sim.rollout.max_batch_size,
        max_new_tokens=sim.workload.max_response_tokens))
    config.validate()
    workload = synthetic.Workload(sim.workload, config.seed)
    train_set, eval_set = workload.prompt_sets()
    efficiency = sim.efficiency_factors()
    rollout_cost = CostModel(sim.rollout.accelerator, sim.model, efficiency, tp=sim.rollout.tp)
    train_cost = CostModel(sim.train.accelerator, sim.model, efficiency, tp=sim.train.tp)
    costs = {tp: CostModel(sim.rollout.accelerator, sim.model, efficiency, tp=tp)
             for tp in set(tps)}
    engines = [SimInferenceEngine(costs[tps[i]], length_of=workload.response_tokens,
                                  correct_of=workload.correct,
                                  max_batch_size=worker_batch_size(
                                      config.routing, i, sim.rollout.max_batch_size),
                                  partial_rollout=config.window.partial_rollout,
                                  trace=timeline.recorder("rollout", i) if timeline else None,
                                  episode_of=workload.episode,
                                  carry_kv=sim.migration == "carry_kv",
                                  update=weight_update(config, costs[tps[i]]))
               for i in range(len(tps))]
    move_s = sim.move_setup_s + rollout_cost.weight_sync_seconds(
        rollout_cost.weights_bytes / sim.rollout.tp, rollout_cost.accelerator.intra_node_bandwidth)
    # one broadcast; the instances with the narrowest tp receive the largest shards
    sync_s = weight_sync_seconds(config, costs[min(tps)], train_cost)
    colocated = config.cluster.placement == "colocated"
    devices = Devices(tuple(tps), sim.train.devices, colocated,
                      switch_seconds(config, rollout_cost) if colocated else 0.0)
    trainer = scenario_trainer(config, train_cost)
    runtime = SimRuntime(engines, trainer, sync_s, timeline,
                         move_s=move_s, replica_groups=sim.rollout.tp / sim.train.tp,
                         devices=devices,
                         pause_to_receive=getattr(sim, "reproduces", "eddy") == "verl")
    rollout = config.rollout
    settings = loop_settings(
        config, SamplingParams(max_new_tokens=rollout.max_new_tokens,
                               temperature=rollout.temperature), pad_id=0,
        trainer_ranks=sim.train.groups,
        plan_cost=rollout_cost if config.adaptive.enabled else None)
    controller = build_controller(settings, runtime, train_set, eval_set,
                                  decode=synthetic.decode, reward=SafeReward(synthetic.reward),
                                  log=log, build_batch=build_sim_batch)
    return controller, runtime


def simulate(config: EddyConfig, log: Callable[[dict[str, Any]], None] = lambda m: None,
             trace_path: str | None = None, timeline_png: str | None = None
             ) -> dict[str, Any]:
    """Run `config` on the simulated cluster; the controller's summary plus the simulator's
    accounting. With `trace_path`, every worker's busy intervals go there as a Perfetto /
    Chrome trace; with `timeline_png`, as a plot of worker activity and roles."""
    timeline = Timeline() if trace_path or timeline_png else None
    controller, runtime = build(config, log, timeline)
    cpu_began, wall_began = time.process_time(), time.perf_counter()
    summary, virtual_s = run_virtual(controller.run())
    cpu_s, wall_s = time.process_time() - cpu_began, time.perf_counter() - wall_began
    instances = len(runtime.workers)
    rollout_busy = sum(engine.stats().busy_seconds for engine in runtime.workers)
    steps = [m for m in controller.history if m.get("step", 0) > 0]
    runtime.close_roles(virtual_s)
    if trace_path:
        timeline.write(trace_path)
    if timeline_png:
        timeline.plot(timeline_png, f"{instances} rollout instances, "
                      f"{runtime.trainer.dp} trainer groups")
    # steady state: from the end of the first step (the pipeline is full) to the last one's
    steady = runtime.idle_between(1, len(runtime.marks)) if len(runtime.marks) > 1 else \
        (None, None, None)
    return {**summary, "simulated_s": virtual_s, "wall_s": wall_s, "cpu_s": cpu_s,
            "rollout_instances": instances, "train_groups": runtime.trainer.dp,
            "rollout_idle": 1 - rollout_busy / max(virtual_s * instances, 1e-12),
            "train_idle": 1 - runtime.train_busy_s / max(virtual_s, 1e-12),
            "rollout_idle_steady": steady[0], "train_idle_steady": steady[1],
            "device_idle_steady": steady[2], "devices": runtime.devices.total,
            "device_idle": 1 - runtime.device_busy_s() / max(
                virtual_s * runtime.devices.total, 1e-12),
            "preemptions": sum(engine.preemptions for engine in runtime.workers),
            "tool_calls": sum(engine.tool_calls for engine in runtime.workers),
            "tool_failures": sum(engine.tool_failures for engine in runtime.workers),
            "tool_wait_s": sum(engine.tool_wait_s for engine in runtime.workers),
            "cpu_per_step_fraction": cpu_s / max(virtual_s, 1e-12),
            "step_s_mean": sum(m["step_s"] for m in steps) / max(len(steps), 1),
            "history": controller.history}

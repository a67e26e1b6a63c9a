"""The root of Eddy's config tree. Each section is a typed dataclass owned by the component it
configures and validated by its own `validate(prefix)`; the root adds cross-section checks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, is_dataclass

from ..checkpoints import CheckpointConfig
from ..core.config import AlgorithmConfig, LoopConfig, WindowConfig
from ..core.replay import ReplayConfig
from ..engines.config import RolloutConfig, TrainConfig, check_platform_name
from ..envs.config import EnvConfig
from ..errors import ConfigError
from ..models.config import ModelConfig
from ..observability.config import ObserveConfig
from ..preflight import PreflightConfig
from ..runtime.config import ClusterConfig
from ..scheduler.adaptive import AdaptiveConfig
from ..scheduler.routing_config import RoutingConfig
from ..scheduler.elastic import ElasticConfig
from ..tasks.config import DataConfig
from ..usercode.config import UserCodeConfig
from ..validation import check_finite_fields, contradiction

# The largest seed. Rollout worker i's engine is seeded with seed * 1000 + i
# (runtime/rollout_worker.py), and vLLM seeds numpy's legacy generator with it, which takes
# [0, 2^32 - 1] only (torch takes [-2^63, 2^64 - 1], `random` any integer): so seed * 1000 + 999
# must stay below 2^32.
MAX_SEED = (2 ** 32 - 1000) // 1000


@dataclass(kw_only=True, slots=True)
class EddyConfig:
    platform: str = "auto"  # a platform name, or "auto": EDDY_PLATFORM, else detection
    seed: int = 0
    run_dir: str | None = None  # None: runs/<date>-<time>
    # go on from a checkpoint: "auto" (the newest good one in run_dir, else start fresh), or
    # the path of a checkpoint, a run directory or its checkpoints/ directory; None: fresh
    resume: str | None = None
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    # the version window: K, in-flight groups, refill, partial rollout, DORA's migration/fill
    window: WindowConfig = field(default_factory=WindowConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn episodes; none: single-turn
    # where rewards and environment steps run: worker threads, processes, or inline
    user_code: UserCodeConfig = field(default_factory=UserCodeConfig)
    # metrics to TensorBoard / W&B and the worker trace, besides metrics.jsonl
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    # what `eddy train` checks before it starts anything: the memory plan (`eddy plan`)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)

    def validate(self, prefix: str = "", *, check_files: bool = True) -> None:
        """`check_files` False: the model directory need not exist here (a config read
        without its model: `eddy config show`, `eddy plan`); a run's start always checks it."""
        check_finite_fields(self)  # every float of the tree, before any range check
        check_platform_name("platform", self.platform)
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(
                f"config key 'seed' = {self.seed} is out of range; allowed: [0, {MAX_SEED}] "
                "(each rollout worker's engine is seeded with seed * 1000 + its index, and "
                "numpy, which vLLM seeds with it, takes seeds below 2^32 only)")
        for f in fields(self):
            section = getattr(self, f.name)
            if section is self.model:
                section.validate(f.name, check_files=check_files)
            elif is_dataclass(section):
                section.validate(f.name)
        slots = int(self.replay.max_fraction * self.loop.batch_prompts + 1e-9)
        if slots >= self.loop.batch_prompts:
            raise contradiction(
                f"replay.max_fraction = {self.replay.max_fraction} leaves no fresh group in a "
                f"batch of loop.batch_prompts = {self.loop.batch_prompts}; every step needs "
                "fresh data (max_fraction < 1)")
        algo, window = self.algorithm, self.window
        fresh = self.loop.batch_prompts - slots
        if self.train.stream_chunks > fresh:
            raise contradiction(
                f"train.stream_chunks = {self.train.stream_chunks} with {fresh} fresh group(s) a "
                f"step (loop.batch_prompts = {self.loop.batch_prompts}, replay.max_fraction = "
                f"{self.replay.max_fraction}): each part of a streamed step needs at least one "
                "fresh group; lower stream_chunks")
        if window.refill == "batch" and 0 < window.max_inflight_prompts < fresh:
            raise contradiction(
                f"window.refill = batch with window.max_inflight_prompts = "
                f"{window.max_inflight_prompts} < the {fresh} fresh groups of a batch: "
                "whole-batch refill dispatches a batch only when all of it fits in flight, so "
                f"no batch would ever start; raise window.max_inflight_prompts to at least "
                f"{fresh} or set window.refill = stream")
        if window.max_staleness > 0 and algo.dynamic_sampling and algo.max_refill_rounds > 0:
            raise contradiction(f"algorithm.max_refill_rounds = {algo.max_refill_rounds} with "
                                f"window.max_staleness = {window.max_staleness}: refills are "
                                "generated synchronously; use them only with max_staleness = 0")
        self._check_staleness()
        self._check_elastic()
        self._check_routing()
        self._check_colocated()
        self._check_local_runtime()
        if self.data.task == "tool_add" and self.data.train_path is None and \
                self.env.name is None:
            raise contradiction(
                "data.task = tool_add is solved with a calculator, but env.name is not set; "
                "set env.name = calculator (and env.options.syntax = tiny for the tiny model)")

    def _check_staleness(self) -> None:
        """A K the run cannot use. No group trained in a run of `loop.steps` = S steps can be
        more than S - 1 versions old (the last step trains at version S - 1), so K >= S bounds
        nothing more than K = S - 1 would; with the window admitting every group the bound
        allows (`max_inflight_prompts` = 0: (K + 1) x batch_prompts in flight) it only lets
        rollout run further ahead, and up to K x batch_prompts groups still generating when the
        run ends are drained and never trained: at least as many as the whole run trains."""
        k, steps, batch = self.window.max_staleness, self.loop.steps, self.loop.batch_prompts
        if k == 0 or steps == 0 or k < steps or self.window.max_inflight_prompts or \
                self.window.max_started_per_sync:
            return
        warnings.warn(
            f"window.max_staleness = {k} with loop.steps = {steps}: no trained group can be "
            f"more than {steps - 1} version(s) old in {steps} step(s), and up to {k} x "
            f"loop.batch_prompts = {k * batch} groups generated ahead are never trained (the "
            f"run trains {steps * batch}); set window.max_staleness <= {max(steps - 1, 0)}, or "
            "bound the groups in flight with window.max_inflight_prompts", UserWarning,
            stacklevel=3)

    def longest_sequence(self) -> int:
        """The longest sequence the run generates: a prompt of data.max_prompt_tokens and a
        response of rollout.max_new_tokens (a multi-turn episode's whole transcript counts
        against max_new_tokens). The rollout engines start with this context."""
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens

    def rollout_engine_options(self) -> dict:
        """The inference engine's memory keyword arguments (`RolloutConfig.engine_options`)."""
        return self.rollout.engine_options(self.longest_sequence())

    def runtime_kind(self) -> str:
        """The runtime this run uses: `cluster.runtime`, with "auto" resolved. A job that fits
        one process (no cluster address, one trainer rank, split placement, no elastic pool)
        runs local: no Ray start-up, no actor processes each loading torch and the model, no
        object-store round trips (measured in bench/results/README.md); anything else on Ray.
        What local gives up besides: a crashed rollout engine is the run's end, not a worker
        replaced."""
        cluster = self.cluster
        if cluster.runtime != "auto":
            return cluster.runtime
        fits = (cluster.address is None and self.train.num_workers == 1
                and cluster.placement == "split" and not self.elastic.enabled)
        return "local" if fits else "ray"

    def _check_local_runtime(self) -> None:
        """One process holds what `cluster.runtime = local` runs: no other process to lend,
        replace or time-share with."""
        if self.cluster.runtime != "local":
            return
        key = "cluster.runtime = local"
        if self.train.num_workers != 1:
            raise contradiction(f"{key} runs one trainer rank in this process; "
                                f"train.num_workers = {self.train.num_workers} needs "
                                "cluster.runtime = ray")
        if self.cluster.placement != "split":
            raise contradiction(f"{key} with cluster.placement = {self.cluster.placement}: "
                                "no engine sleeps while the trainer trains in one process; "
                                "use cluster.placement = split or cluster.runtime = ray")
        if self.elastic.enabled:
            raise contradiction(f"{key} with elastic.enabled = True: the elastic pool lends a "
                                "rollout worker's process to training; use cluster.runtime = "
                                "ray")

    def _check_colocated(self) -> None:
        """Time-sharing devices leaves no room for a role to run while the other does."""
        if self.cluster.placement != "colocated":
            return
        key = "cluster.placement = colocated"
        if self.window.highest_staleness > 0:
            raise contradiction(
                f"{key} with window.max_staleness = {self.window.max_staleness}"
                + (f" (the governor may raise it to {self.window.highest_staleness})"
                   if self.window.highest_staleness > self.window.max_staleness else "")
                + ": "
                "colocated roles take turns on the same devices, so nothing generates while "
                "the trainer trains; asynchronous training needs cluster.placement = split "
                "(or set max_staleness = 0)")
        if self.train.stream_chunks > 1:
            raise contradiction(
                f"{key} with train.stream_chunks = {self.train.stream_chunks}: a streamed step "
                "trains its first parts while the rest generate, and colocated roles take "
                "turns on the same devices; set stream_chunks = 1 or cluster.placement = split")
        if self.elastic.enabled:
            raise contradiction(
                f"{key} with elastic.enabled = True: the elastic pool lends split rollout "
                "workers to training; colocated workers already train on every device")
        rollout = self.rollout.platform or self.platform
        train = self.train.platform or self.platform
        if rollout != train:
            raise contradiction(
                f"{key} with rollout on {rollout!r} and training on {train!r}: colocated "
                "roles share devices, so they run on one platform")

    def _check_routing(self) -> None:
        routing = self.routing
        if routing.policy == "none":
            return
        workers = sum(spec.workers for spec in routing.buckets)
        if workers != self.rollout.num_workers:
            raise contradiction(
                f"routing.buckets give {workers} worker(s) "
                f"({', '.join(f'{b.name}: {b.workers}' for b in routing.buckets)}) but "
                f"rollout.num_workers = {self.rollout.num_workers}; every rollout worker "
                "belongs to exactly one bucket")
        sized = [b.name for b in routing.buckets if b.max_batch_size is not None]
        if sized and self.adaptive.enabled:
            raise contradiction(
                f"routing.buckets {sized} set their own max_batch_size while adaptive.enabled "
                "= True: the adaptive scheduler's plans set one concurrency for every worker. "
                "Drop the per-bucket max_batch_size or switch adaptive off")

    def _check_elastic(self) -> None:
        from ..core.elastic_driver import parse_schedule

        if self.adaptive.enabled and self.adaptive.switch_partial_rollout and \
                self.window.fill_legacy:
            raise contradiction(
                "adaptive.switch_partial_rollout = True with window.fill_legacy = True: DORA's "
                "legacy fill keeps every trajectory on one policy version, which partial "
                "rollout would break; leave switch_partial_rollout off")

        if not self.elastic.enabled:
            return
        parse_schedule(list(self.elastic.schedule), self.rollout.num_workers)
        if self.rollout.num_workers <= self.elastic.min_rollout_workers:
            raise contradiction(
                f"elastic.enabled = True with rollout.num_workers = {self.rollout.num_workers} "
                f"and elastic.min_rollout_workers = {self.elastic.min_rollout_workers}: no "
                "rollout worker could ever be lent to training")
        if self.train.mini_batches != 1:
            raise contradiction(
                f"elastic.enabled = True with train.mini_batches = {self.train.mini_batches}: "
                "a rollout worker lent to training (engines/training/replica.py) holds the "
                "weights of the last weight sync and no optimizer, and computes its share's "
                f"gradients once per RL step; with {self.train.mini_batches} optimizer steps "
                f"per RL step, steps 2..{self.train.mini_batches} run on weights it receives "
                "only at the next weight sync, so its gradients would be stale; set "
                "train.mini_batches = 1 or elastic.enabled = false")
        if self.algorithm.kl_coef > 0:
            raise contradiction(
                f"elastic.enabled = True with algorithm.kl_coef = {self.algorithm.kl_coef}: a "
                "joined replica holds no reference model; set kl_coef = 0")
        if self.train.lora.enabled:
            raise contradiction(
                f"elastic.enabled = True with train.lora.rank = {self.train.lora.rank}: a "
                "joined replica trains whole weights, not LoRA adapters; set "
                "train.lora.rank = 0 or elastic.enabled = False")

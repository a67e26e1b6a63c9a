"""The RL loop. Short enough to read like the algorithm, and time-agnostic: it awaits only what
the runtime gives it and takes timestamps from `runtime.now()`, so the same loop runs on Ray and
under a simulator's virtual clock. It does no I/O; metrics go to the `log` callback.

Each step keeps the rollout full (as many groups in flight as the version window admits: up
to K + 1 batches), trains on the fresh batch the window hands out (the first collected groups
that keep every other group within K versions; K = 0 is synchronous GRPO on the current
weights) plus replayed groups (ReFlow's replay cycle: at most floor(sigma*B), weighted tau,
lag <= delta), then publishes the new weights to every rollout worker and lets the assignment
move legacy-version work off the workers the new version needs (DORA). A streamed step
(`stream_chunks` > 1, verl's fully asynchronous trainer) trains its batch in parts, each as
soon as it is collected, and publishes once. Streaming itself
(workers, store, scoring, migration) is `rollout.StreamingRollout`. The ledger records every
group's lifecycle: the proof that each prompt was trained exactly once as fresh data. With
`window.governor`, the stability governor (`governor.py`) reads each step's record and sets K
for the groups dispatched after it.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..metric_kinds import combine_parts
from ..protocol import Group, SamplingParams
from ..tasks.prompts import Prompt, PromptQueue, PromptSet
from .idle import IdleWatch
from .config import AlgorithmConfig, LoopConfig, WindowConfig
from .elastic_driver import ElasticDriver, NoElastic
from .governor import Governor, Signals
from .ledger import Ledger
from .replay import ReplayBuffer, ReplayConfig
from .requests import Purpose
from .rewarding import SafeReward
from .rollout import StreamingRollout
from .step_metrics import (RolloutCounters, counters_since, eval_metrics, rollout_metrics,
                           step_record)
from .trainer_recovery import TrainerRecovery
from .version_window import VersionWindow

from ..scheduler.adaptive import AdaptiveConfig
from ..scheduler.elastic import ElasticConfig
from ..scheduler.routing_config import RoutingConfig

if TYPE_CHECKING:
    from ..envs.hosting import EnvHost
    from ..envs.loading import EnvironmentFactory
    from ..runtime_protocol import Runtime
    from ..scheduler.cost_model import CostModel


@dataclass
class LoopSettings:
    """The settings the loop reads: config sections, and what the run derives from its
    tokenizer and model (sampling, padding, environments, the plan cost model).
    `eddyrl.build.loop_settings` makes them from a run's config."""

    loop: LoopConfig
    algorithm: AlgorithmConfig
    sampling: SamplingParams
    n_samples: int
    seed: int
    pad_id: int
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    window: WindowConfig = field(default_factory=WindowConfig)
    max_batch_size: int = 256  # sequences one worker decodes together (`rollout.*`)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    trainer_ranks: int = 1  # the elastic pool's fixed core
    # the step's batch trained in this many parts, each once its groups are collected
    # (`train.stream_chunks`: verl's fully asynchronous trainer)
    stream_chunks: int = 1
    plan_cost: CostModel | None = None  # the rollout devices' cost model, for plan predictions
    # every response is a multi-turn episode in one of its environments (`env` config
    # section), hosted in a user-code pool (`EnvHost`) or inline; None: single-turn
    env: EnvironmentFactory | EnvHost | None = None
    # the platform each role runs on, by name: recorded in checkpoints (run_state.py)
    platforms: dict[str, str] = field(default_factory=dict)


@dataclass
class Controller:
    """The loop and its collaborators; `eddyrl.build.build_controller` wires them."""

    runtime: Runtime
    settings: LoopSettings
    rollout: StreamingRollout
    window: VersionWindow
    replay: ReplayBuffer
    prompt_queue: PromptQueue
    train_prompts: PromptSet
    eval_prompts: PromptSet
    reward: SafeReward
    # Libra's elastic pool (with the adaptive driver inside), or `NoElastic` (which still
    # drives the adaptive scheduler's plans when that is on)
    # groups -> what runtime.train takes: token tensors for real engines
    # (`batching.build_train_batch`); the simulator passes a builder that only counts tokens
    # (a 1,024-device step's tensors would not fit)
    build_batch: Callable[..., Any]
    elastic: ElasticDriver | NoElastic = field(default_factory=NoElastic)
    log: Callable[[dict[str, Any]], None] = lambda metrics: None
    # each evaluation's groups with the policy version they were scored at: the run keeps
    # a few as readable samples (observability/samples.py)
    on_samples: Callable[[int, list[Group]], None] = lambda version, groups: None
    # stops a run that trains nothing, saying why (`loop.max_idle_steps`); None: never
    idle: IdleWatch | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    _ids: Any = field(default_factory=itertools.count)
    # groups a resume handed back (their output was not kept): generated before new prompts
    _requeued: deque = field(default_factory=deque)
    # awaited between steps (not after the last: the caller saves the end state after the
    # drain) with the step just taken; the run's checkpoints live there, outside the loop
    checkpoint: Callable[[int], Awaitable[None]] | None = None

    def __post_init__(self) -> None:
        self.fresh_per_step = self.replay.fresh_slots(self.settings.loop.batch_prompts)
        # the stability governor sets the window's K after each step (`window.governor`)
        self.governor = Governor.from_config(self.settings.window) \
            if self.settings.window.governor else None
        # every trainer call survives a lost trainer rank where the runtime can rebuild it:
        # the call runs again, and this loop sees it return once (trainer_recovery.py)
        self.trainer = TrainerRecovery(self.runtime, self.runtime.now)

    def surviving(self, call: Callable[..., Awaitable[Any]], what: str
                  ) -> Callable[..., Awaitable[Any]]:
        """`call` (a trainer call made outside the loop: a checkpoint's save) through the
        trainer's recovery."""
        async def survived(*args: Any) -> Any:
            return await self.trainer.call(what, lambda: call(*args))
        return survived

    @property
    def version(self) -> int:
        """The trainer's policy version: the number of training steps taken."""
        return self.window.version

    def state(self) -> dict[str, Any]:
        """The loop's own part of a checkpoint (`run_state.py` takes the rest from its
        collaborators): the id the next new group gets, and the governor's K when it is on."""
        next_id = next(self._ids)  # a count cannot be read without taking a value: put it back
        self._ids = itertools.count(next_id)
        return {"next_group_id": next_id,
                **({"governor": self.governor.state()} if self.governor else {})}

    def restore(self, state: dict[str, Any], requeued: list[Group]) -> None:
        """Go on from `state`; `requeued`: groups a resume hands back (their output was not
        kept), generated again before any new prompt. The governor goes on from its saved K (a
        checkpoint without one, or a resume with the governor off, starts from the config's)."""
        self._ids = itertools.count(state["next_group_id"])
        self._requeued.extend(requeued)
        if self.governor is not None and state.get("governor"):
            self.governor.restore(state["governor"])
            self.window.set_max_staleness(self.governor.k)

    async def run(self) -> dict[str, Any]:
        """Steps up to `loop.steps`; a controller restored from a checkpoint (`run_state`)
        goes on after its last step, with its weights published to the workers first."""
        loop = self.settings.loop
        started = self.runtime.now()
        if self.history:
            initial = self.history[0]
            self.rollout.published(self.version, await self.trainer.call(
                "weight export", lambda: self.runtime.sync_weights(self.version)))
        else:
            initial = await self.evaluate()
            self._emit({"step": 0, **initial})
        step = first = self.history[-1]["step"]
        stopped = None  # why the run stopped before loop.steps, when it did
        for step in range(first + 1, loop.steps + 1):
            self.ledger.step = step
            metrics = await self.step()
            out_of_time = bool(loop.max_seconds) and \
                self.runtime.now() - started >= loop.max_seconds
            if (loop.eval_every and step % loop.eval_every == 0) or step == loop.steps \
                    or out_of_time:
                metrics.update(await self.evaluate())
            self._emit({"step": step, **metrics})
            if self.idle is not None and self.idle.stepped(metrics.get("samples_trained", 0)):
                stopped = self.idle.message()
                break
            if out_of_time:
                break
            if self.checkpoint is not None and step < loop.steps:
                await self.checkpoint(step)
        await self.rollout.drain()  # groups still generating finish (collected, never trained)
        await self.elastic.drain()
        final = next(m for m in reversed(self.history) if "eval_accuracy" in m)
        return {"initial_eval_accuracy": initial["eval_accuracy"],
                "final_eval_accuracy": final["eval_accuracy"], "steps": step,
                "seconds": self.runtime.now() - started,
                "samples_trained": sum(m.get("samples_trained", 0) for m in self.history),
                "tokens_generated": sum(m.get("gen_tokens", 0) for m in self.history),
                "replayed_samples": sum(m.get("replay_samples", 0) for m in self.history),
                "reward_errors": self.reward.errors,
                **({"reward_first_error": self.reward.first_error}
                   if getattr(self.reward, "first_error", None) else {}),
                "skipped_updates": sum(m.get("skipped_updates", 0) for m in self.history),
                **({"stopped_early": stopped} if stopped else {}),
                **({"governor": self._governor_report()} if self.governor else {}),
                **({"trainer_recoveries": self.trainer.events} if self.trainer.events else {}),
                "ledger": {state.value: n for state, n in self.ledger.counts().items()},
                "workers_lost": self.rollout.workers_lost,
                **({"stray_results": dict(self.rollout.stray)} if self.rollout.stray else {}),
                **({"routing": self._routing_report()} if self.rollout.router else {}),
                **({"env": report} if (report := self.rollout.episodes.report()) else {}),
                **({"elastic": report} if (report := self.elastic.report()) else {}),
                **({"adaptive": report} if isinstance(self.elastic, NoElastic) and
                   (report := self.elastic.adaptive.report()) else {})}

    def _governor_report(self) -> dict[str, Any]:
        actions = [m.get("governor_action") for m in self.history]
        return {"k": self.governor.k, "lowered": actions.count("lower"),
                "raised": actions.count("raise")}

    def _routing_report(self) -> dict[str, Any]:
        stats = self.rollout.router.stats()
        return {"policy": self.settings.routing.policy, "moves": stats.moves,
                "blocked_moves": stats.blocked, "predictions": stats.predictions}

    async def step(self) -> dict[str, Any]:
        """Wait for the fresh batch the window allows (`rollout_s`), add replayed groups, train,
        publish the new weights, rebalance workers between versions. A streamed step
        (`stream_chunks` > 1) waits for and trains its batch in parts, each as soon as its
        groups are collected, and publishes once, after the last: the same groups, optimizer
        steps and version as one part. A step whose groups all carry no signal trains
        nothing but still advances the version, so the window admits the next batch."""
        t0, before = self.runtime.now(), RolloutCounters.of(self.rollout)
        replayed = self.replay.select(self.settings.loop.batch_prompts, self.version)
        fresh: list[Group] = []
        generated: list[Group] = []
        parts: list[dict[str, float]] = []
        training_s = 0.0
        for count, replayed_part in self._parts(replayed):
            kept, made = await self.collect_fresh(count)
            fresh += kept
            generated += made
            started = self.runtime.now()
            if kept or replayed_part:
                parts.append(await self._train(kept, replayed_part))
            training_s += self.runtime.now() - started
        # the parts' metrics as one step's (metric_kinds.py); the time waited for groups and
        # the time trained, each added over the parts
        train_metrics = combine_parts(parts)
        t2 = self.runtime.now()
        t1 = t2 - training_s
        self.window.advance()
        self.rollout.published(self.version, await self.trainer.call(
            "weight export", lambda: self.runtime.sync_weights(
                self.version, hold=self.rollout.holding())))
        t3 = self.runtime.now()
        self._after_training(fresh, [group for group, _ in replayed])
        record = step_record(self.version, fresh, replayed,
                             rollout_metrics(generated, self.reward.errors), train_metrics,
                             self.window.running, (t0, t1, t2, t3))
        record |= self._govern(record) | self.trainer.drain()
        # DORA: the new version's share of workers, before its prompts are dispatched.
        await self.rollout.rebalance(self._dispatchable_groups() * self.settings.n_samples)
        record |= await self._boundary(record)
        return record | RolloutCounters.of(self.rollout).since(before)

    def _parts(self, replayed: list[tuple[Group, float]]
               ) -> list[tuple[int, list[tuple[Group, float]]]]:
        """The step's parts: fresh groups to wait for, and replayed groups to train beside
        them (spread over the parts), one part unless the step is streamed."""
        chunks = self.settings.stream_chunks
        size, extra = divmod(self.fresh_per_step, chunks)
        return [(size + (index < extra), replayed[index::chunks]) for index in range(chunks)]

    async def _train(self, fresh: list[Group], replayed: list[tuple[Group, float]]
                     ) -> dict[str, float]:
        """One training call on `fresh` and `replayed` groups (weighted τ), through the
        trainer's recovery."""
        groups = fresh + [group for group, _ in replayed]
        weights = [1.0] * len(fresh) + [weight for _, weight in replayed]
        batch = self.build_batch(groups, self.settings.pad_id, weights=weights,
                                 normalize_std=self.settings.algorithm.normalize_std,
                                 correction_scale=self._correction_scale())
        replicas = self.elastic.replicas()
        return await self.trainer.call("train_step", lambda: self.runtime.train(batch, replicas))

    def _correction_scale(self) -> float | None:
        """The governor's scale of the correction's bounds for this step's batch; None (the
        configured bounds) without a governor or while it has not narrowed them."""
        if self.governor is None or self.governor.scale == 1.0:
            return None
        return self.governor.scale

    def _govern(self, record: dict[str, Any]) -> dict[str, Any]:
        """The governor's K from this step's signals, for the groups dispatched from now on
        (those in flight keep their deadlines: `VersionWindow.set_max_staleness`)."""
        if self.governor is None:
            return {}
        decision = self.governor.decide(Signals.of(record))
        self.window.set_max_staleness(decision.k)
        return decision.metrics()

    async def _boundary(self, record: dict[str, Any]) -> dict[str, Any]:
        """The elastic pool's and the adaptive scheduler's turn, after the step's weight sync;
        the pool's time (`elastic_s`) is on the critical path."""
        started = self.runtime.now()
        metrics = await self.elastic.boundary(self.version, self.version, record)
        if isinstance(self.elastic, ElasticDriver):
            metrics["elastic_s"] = self.runtime.now() - started
        return metrics

    def _after_training(self, fresh: list[Group], replayed: list[Group]) -> None:
        """Ledger: fresh groups were trained once and go to replay (or are done); replays count."""
        for group in replayed:
            self.ledger.replayed(group.group_id, self.ledger.step)
        for group in fresh:
            self.ledger.train_fresh(group.group_id, self.ledger.step)
            if self.replay.add(group, group.dispatch_version, group.is_informative()):
                self.ledger.to_replay(group.group_id)
            else:
                self.ledger.finish(group.group_id)
        self._record_evictions()

    def _record_evictions(self) -> None:
        for group_id, reason in self.replay.evicted_since_last():
            self.ledger.evict(group_id, f"replay: {reason}")

    def _dispatchable_groups(self) -> int:
        """Fresh groups `fill_pipeline` would dispatch now: whole batches, or with streaming
        refill every group the window has room for."""
        size, room = self.fresh_per_step, self.window.capacity()
        if not size:
            return 0
        return room if self.settings.window.refill == "stream" else room // size * size

    def fill_pipeline(self) -> None:
        """Dispatch fresh groups while the version window admits them at the latest version
        (whole batches, or any number with streaming refill): one batch at a time with K = 0
        (synchronous), up to K + 1 ahead of training (or `window.max_inflight_prompts`)
        otherwise; then, with `window.fill_legacy`, fill free slots of workers still busy
        with a legacy version with new prompts of that version, where their deadline allows
        (DORA's opportunistic fill)."""
        if self.rollout.latest != self.window.version:
            return  # a step has advanced the version; its weights are not on the workers yet
        n = self.settings.n_samples
        while count := self._dispatchable_groups():
            self.rollout.dispatch(self._queue_groups(count), n, self.settings.sampling)
        if not self.settings.window.fill_legacy or self.rollout.partial_rollout:
            return
        for worker, version, free_slots in self.rollout.legacy_room():
            count = min(free_slots // n, self.window.capacity(version))
            if count > 0:
                self.rollout.dispatch(self._queue_groups(count), n, self.settings.sampling,
                                      version=version, worker=worker)

    def _queue_groups(self, count: int) -> list[Group]:
        """`count` groups to dispatch: those a resume requeued first (drawn before anything
        still in the prompt queue), then new ones."""
        requeued = [self._requeued.popleft() for _ in range(min(count, len(self._requeued)))]
        drawn = self.prompt_queue.take(count - len(requeued))
        groups = self._new_groups([prompt for _, prompt in drawn])
        for group, (epoch, prompt) in zip(groups, drawn):
            self.ledger.queue(group.group_id, prompt.index, epoch)
        return requeued + groups

    async def collect_fresh(self, count: int) -> tuple[list[Group], list[Group]]:
        """The next `count` fresh groups the window hands out (C3 is checked for every group
        in them), kept and generated; with dynamic sampling, uninformative groups are dropped
        (recorded as evicted) and, in synchronous mode, refilled from new prompts for up to
        `max_refill_rounds`."""
        algo = self.settings.algorithm
        self.fill_pipeline()
        if not count:
            return [], []
        generated = await self.rollout.next_batch(count)
        # Taking the batch may free in-flight room (window.max_inflight_prompts): the next batch
        # starts generating now, while this one trains.
        self.fill_pipeline()
        kept = self._drop_uninformative(generated)
        for _ in range(algo.max_refill_rounds if algo.dynamic_sampling else 0):
            if len(kept) >= count:
                break
            groups = self._queue_groups(count - len(kept))
            await self.rollout.generate_now(groups, self.settings.n_samples,
                                            self.settings.sampling, Purpose.REFILL)
            generated += groups
            kept += self._drop_uninformative(groups)
        if self.idle is not None:
            self.idle.saw(generated)
        return kept, generated

    def _drop_uninformative(self, groups: list[Group]) -> list[Group]:
        if not self.settings.algorithm.dynamic_sampling:
            return list(groups)
        kept = []
        for group in groups:
            if group.is_informative():
                kept.append(group)
            else:
                self.ledger.evict(group.group_id, "no learning signal (equal rewards)")
        return kept

    def _new_groups(self, prompts: list[Prompt]) -> list[Group]:
        return [Group(f"g{next(self._ids)}", p.prompt, p.answer, list(p.prompt_ids),
                      self.version) for p in prompts]

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: one response per held-out prompt at `loop.eval_temperature`."""
        sampling = SamplingParams(**{**vars_of(self.settings.sampling),
                                     "temperature": self.settings.loop.eval_temperature})
        episodes = self.rollout.episodes
        env_before = episodes.eval_stats.metrics("eval_env/")
        groups = await self.rollout.generate_now(self._new_groups(self.eval_prompts.prompts), 1,
                                                 sampling, Purpose.EVAL)
        if self.idle is not None and not self.history:  # the starting model's evaluation
            self.idle.check_initial(groups)
        self.on_samples(self.version, groups)
        env_metrics = counters_since(episodes.eval_stats.metrics("eval_env/"), env_before)
        return {**eval_metrics(groups), **env_metrics}

    def _emit(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        self.log(metrics)


def vars_of(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__slots__}

"""Wiring: the controller and every collaborator it drives, built in one place from the run's
settings and runtime. `eddy train` (Ray), `eddy sim` (virtual time), `eddy eval` (in process)
and the tests build their controller here, so a mechanism is switched on or off by its config
section alone and an absent one is a null object (`NoElastic`, `NoAdaptive`, `NoRecovery`),
never a `None` checked in the loop.

The runtime's optional capabilities (`runtime_protocol`) are asked for here, once: a setting
that needs one the runtime lacks is refused by name before the run starts.
"""

from __future__ import annotations

from typing import Any, Callable

from .core.adaptive_driver import AdaptiveDriver, NoAdaptive
from .core.batching import build_train_batch
from .core.idle import IdleWatch, reward_name
from .core.controller import Controller, LoopSettings
from .core.elastic_driver import ElasticDriver, NoElastic, build_pool, parse_schedule
from .core.episodes import Episodes, NoEpisodes
from .core.ledger import Ledger
from .core.moves import NoRecovery
from .core.replay import ReplayBuffer
from .core.rewarding import SafeReward
from .core.rollout import StreamingRollout
from .core.version_assignment import VersionAssignment
from .core.version_window import VersionWindow
from .errors import ConfigError
from .protocol import SamplingParams
from .runtime.placement import role_platform_names
from .runtime_protocol import Elastic, Plannable, Recoverable, Runtime
from .scheduler.adaptive import AdaptiveScheduler, GenerationPlan
from .scheduler.buckets import BucketRouter, RoutingConfig, bucket_instances
from .scheduler.plan_predictor import PlanPredictor
from .tasks.prompts import PromptQueue


def loop_settings(config: Any, sampling: SamplingParams, pad_id: int, *, trainer_ranks: int,
                  plan_cost: Any = None, env: Any = None) -> LoopSettings:
    """The loop's settings from a run's config (`config.EddyConfig`) and what the run derived
    from its tokenizer and model."""
    rollout = config.rollout
    return LoopSettings(
        loop=config.loop, algorithm=config.algorithm, window=config.window, sampling=sampling,
        n_samples=rollout.n_samples, seed=config.seed, pad_id=pad_id, replay=config.replay,
        max_batch_size=rollout.max_batch_size, elastic=config.elastic,
        adaptive=config.adaptive, routing=config.routing, trainer_ranks=trainer_ranks,
        plan_cost=plan_cost, env=env, stream_chunks=config.train.stream_chunks,
        platforms=role_platform_names(config))


def build_controller(settings: LoopSettings, runtime: Runtime, train_prompts: Any,
                     eval_prompts: Any, decode: Callable[[list[int]], str], reward: SafeReward,
                     log: Callable[[dict[str, Any]], None] = lambda metrics: None,
                     build_batch: Callable[..., Any] = build_train_batch) -> Controller:
    """The controller of one run: its version window, replay buffer, streaming rollout (with
    DORA's version assignment, Libra's router and the environments when on), elastic pool and
    adaptive scheduler, on `runtime`."""
    if not isinstance(runtime, Runtime):
        raise TypeError(f"{type(runtime).__name__} is not a runtime: it lacks some of "
                        "runtime_protocol.Runtime's members")
    loop, window_config = settings.loop, settings.window
    replay = ReplayBuffer(settings.replay)
    fresh_per_step = replay.fresh_slots(loop.batch_prompts)
    # Admission bounds staleness to K: at most K + 1 batches in flight (DORA's RBS > TBS),
    # fewer when the loop caps the groups generating at once.
    window = VersionWindow(max_staleness=window_config.max_staleness,
                           batch_groups=max(fresh_per_step, 1),
                           max_concurrent=window_config.max_inflight_prompts or
                           (window_config.highest_staleness + 1) * loop.batch_prompts,
                           max_started_per_sync=window_config.max_started_per_sync)
    ledger = Ledger()
    rollout = StreamingRollout(
        runtime, window, VersionAssignment(len(runtime.workers), settings.max_batch_size),
        ledger, reward, decode, partial_rollout=window_config.partial_rollout,
        migrate=window_config.migrate, router=_router(settings.routing),
        episodes=Episodes(settings.env, decode) if settings.env else NoEpisodes(),
        recovery=runtime if isinstance(runtime, Recoverable) else NoRecovery())
    controller = Controller(
        runtime, settings, rollout, window, replay,
        PromptQueue(train_prompts, loop.batch_prompts, settings.seed), train_prompts,
        eval_prompts, reward, build_batch, elastic=_elastic(settings, runtime, rollout),
        log=log, ledger=ledger,
        idle=IdleWatch(loop.max_idle_steps, decode, reward_name(reward.fn)))
    if window_config.refill == "stream":
        rollout.on_collect = controller.fill_pipeline
    return controller


def _router(routing: RoutingConfig) -> BucketRouter | None:
    """Libra's bucket router (or one of its baselines), when routing is on."""
    if routing.policy == "none":
        return None
    return BucketRouter(routing, bucket_instances(routing))


def _adaptive(settings: LoopSettings, runtime: Runtime, rollout: StreamingRollout,
              events: list[dict[str, Any]]) -> AdaptiveDriver | NoAdaptive:
    """ReFlow's adaptive scheduler with Libra's planner rule, when on; it plans with or
    without the elastic pool."""
    adaptive = settings.adaptive
    if not adaptive.enabled:
        return NoAdaptive()
    if not isinstance(runtime, Plannable):
        raise ConfigError(f"adaptive.enabled = True: the {type(runtime).__name__} cannot "
                          "change its rollout workers' generation strategy while running")
    router = rollout.router
    # Layouts move workers between buckets, which only makes sense while a bucket's
    # instances are like any other's: not when buckets have their own parallelism (the
    # simulator builds them that wide; a moved instance would keep its width)
    movable = router is not None and \
        len({spec.parallelism for spec in router.config.buckets}) == 1
    plan = GenerationPlan(concurrency=settings.max_batch_size,
                          partial_rollout=settings.window.partial_rollout,
                          layout=router.layout if movable else ())
    cost = settings.plan_cost
    predictor = PlanPredictor(cost, plan, tail_bounds_step=(
        settings.window.max_staleness == 0)) if cost else None
    return AdaptiveDriver(runtime, rollout, AdaptiveScheduler(adaptive, plan, predictor),
                          rollout_group_size=settings.n_samples, predictor=predictor,
                          events=events)


def _elastic(settings: LoopSettings, runtime: Runtime, rollout: StreamingRollout
             ) -> ElasticDriver | NoElastic:
    """Libra's elastic pool, when on: rollout workers lent to training as gradient replicas,
    by the adaptive scheduler's decisions and/or a pinned schedule. The two drivers share one
    list of events (decisions, plans, moves), in the order they happened."""
    events: list[dict[str, Any]] = []
    adaptive = _adaptive(settings, runtime, rollout, events)
    elastic = settings.elastic
    if not elastic.enabled:
        return NoElastic(adaptive)
    if not isinstance(runtime, Elastic):
        raise ConfigError(f"elastic.enabled = True: the {type(runtime).__name__} cannot lend "
                          "rollout workers to training")
    workers = len(runtime.workers)
    return ElasticDriver(runtime, rollout, build_pool(workers, settings.trainer_ranks, elastic),
                         parse_schedule(list(elastic.schedule), workers), adaptive=adaptive,
                         events=events)

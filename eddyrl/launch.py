"""`eddy train`: build everything a run needs from its config, drive the controller, and leave
metrics, a checkpoint and a summary in the run directory."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from . import resume
from .config import EddyConfig, to_yaml
from .core import run_state
from .build import build_controller, loop_settings
from .core.controller import Controller
from .core.rewarding import SafeReward, WeightedRewards, load_reward
from .envs.hosting import host_environments
from .plan.check import check_memory
from .preflight import preflight
from .protocol import SamplingParams
from .run_dir import RunDirectory, write_atomic
from .errors import ConfigError
from .hal import get_platform
from .observability.samples import sample_rows
from .observability.sinks import open_sinks
from .observability.trace import Trace
from .observability.tracing import TracingRuntime, flush_at_checkpoints
from .resolved import ResolvedRun, explicit_role_platforms, runtime_settings, with_role_platforms
from .runtime.placement import role_platform_name, role_platform_names
from .runtime_protocol import Recoverable
from .scheduler.adaptive import AdaptiveConfig
from .scheduler.buckets import RoutingConfig
from .scheduler.elastic import ElasticConfig
from .tasks.config import DataConfig
from .tasks.prompts import PromptSet, load_splits


def resolve_run_dir(config: EddyConfig) -> Path:
    """Absolute: workers in other processes (and file:// rendezvous URLs) need it so."""
    if config.run_dir:
        return Path(config.run_dir).resolve()
    return (Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()


def prepare(config: EddyConfig, model_path: str, data_dir: Path) -> ResolvedRun:
    """What a run works out once: tokenizer, prompt sets, loop settings, the guarded reward
    function, and each worker's settings. The reward and the environments run in the
    user-code pools `user_code` describes (settings.env is the environments' `EnvHost`);
    `ResolvedRun.close` stops them."""
    from .models.config import load_tokenizer

    tokenizer = load_tokenizer(model_path)  # checked against the model's vocabulary
    data = config.data
    train_rows, eval_rows, train_src, eval_src = load_splits(data, data_dir, config.seed)
    train_set = PromptSet.from_rows(train_rows, train_src, tokenizer, data.max_prompt_tokens,
                                    data.prompt_overflow)
    eval_set = PromptSet.from_rows(eval_rows, eval_src, tokenizer, data.max_prompt_tokens,
                                   data.prompt_overflow)
    rollout = config.rollout
    # data.rewards summed with their weights, else data.reward_fn
    fn = load_reward(data.reward_fn, data.reward_specs())
    # Multi-turn: a turn also ends on the environment's stop tokens (a tool call's closing tag);
    # max_new_tokens bounds the whole episode (engines count resumed tokens against it).
    env = config.env.build("env", tokenizer=tokenizer, reward_fn=fn,
                           payload_bytes=config.routing.payload_bytes)
    stop_ids, stop_strings = [tokenizer.eos_token_id], ()
    if env is not None:
        env_ids, stop_strings = env(prompt="", answer="").stop_conditions()
        stop_ids += [i for i in env_ids if i not in stop_ids]
    sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens,
                              temperature=rollout.temperature, top_p=rollout.top_p,
                              top_k=rollout.top_k, stop_token_ids=tuple(stop_ids),
                              stop_strings=stop_strings)
    hosted = None
    reward_pool = config.user_code.reward.build("user_code.reward", name="reward",
                                                sent=_reward_functions(data, fn))
    try:
        hosted = None if env is None else host_environments(env, config.user_code.env)
        settings = loop_settings(config, sampling, tokenizer.pad_token_id,
                                 trainer_ranks=config.train.num_workers,
                                 plan_cost=_plan_cost(config, model_path), env=hosted)
        runtime = runtime_settings(config)
    except BaseException:  # no user-code worker outlives a refused start
        reward_pool.close()
        if hosted is not None:
            hosted.close()
        raise
    return ResolvedRun(config=config, model_path=model_path, tokenizer=tokenizer,
                       train_set=train_set, eval_set=eval_set, settings=settings,
                       reward=SafeReward(fn, timeout_s=data.reward_timeout_s, pool=reward_pool),
                       runtime=runtime)


def _reward_functions(data: DataConfig, fn: Callable) -> tuple[tuple[str, Any], ...]:
    """What the reward pool is sent, each named by its key: every term of `data.rewards`, or
    the one `data.reward_fn`."""
    if not isinstance(fn, WeightedRewards):
        return ((f"data.reward_fn {data.reward_fn!r}", fn),)
    return tuple((f"data.rewards[{i}].fn {spec.fn!r}", term.fn) for i, (spec, term)
                 in enumerate(zip(data.reward_specs(), fn.terms)))


def _plan_cost(config: EddyConfig, model_path: str):
    """The rollout devices' cost model for the adaptive scheduler's plans (None: not needed)."""
    if not config.adaptive.enabled:
        return None
    from .scheduler.plan_predictor import rollout_cost_model

    platform = get_platform(role_platform_name(config, "rollout"), require_available=False)
    model_config = json.loads((Path(model_path) / "config.json").read_text())
    return rollout_cost_model(config.adaptive.accelerator, platform.device_type, model_config)


def evaluate_checkpoint(config: EddyConfig, checkpoint: str, data_dir: Path,
                        verify: bool = True, show: int = 0) -> dict[str, Any]:
    """Held-out accuracy of a saved model, with the same evaluation as `eddy train`. A run
    checkpoint (a directory with a manifest, or a `step_N` directory) is verified against its
    manifest first unless `verify` is False; a plain model directory has nothing to check.
    `show`: the first that many held-out samples go into the result (`samples`)."""
    from . import checkpoints
    from .engines.registry import load_engine_class
    from .engines.training.lora import adapter_base, merged_state
    from .models.config import ModelConfig
    from .runtime.inprocess import InProcessRuntime

    # A LoRA checkpoint (peft's format) holds the adapter; the model is the base it names,
    # with the adapter merged by peft (engines/training/lora.py)
    base = adapter_base(os.path.expanduser(checkpoint)) \
        if os.path.isdir(os.path.expanduser(checkpoint)) else None
    saved = os.path.expanduser(checkpoint) if base else \
        ModelConfig(path=checkpoint).resolve(label=f"checkpoint {checkpoint!r}")
    if verify and ((Path(saved) / checkpoints.MANIFEST).exists()
                   or checkpoints.step_of(Path(saved)) is not None):
        checkpoints.verify(Path(saved))  # a corrupt one is refused by name
    model_path = saved if base is None else ModelConfig(path=base).resolve(
        label=f"base model {base!r} of the LoRA checkpoint {checkpoint!r}")
    weights = None if base is None else merged_state(model_path, saved)
    run = prepare(config, model_path, data_dir)
    # One engine, no trainer: no pool to move workers in, no buckets to route between.
    settings = dataclasses.replace(run.settings, elastic=ElasticConfig(),
                                   adaptive=AdaptiveConfig(), routing=RoutingConfig(),
                                   plan_cost=None)
    rollout = run.runtime.rollout
    platform = get_platform(rollout.platforms.rollout)  # eval needs no trainer
    engine = load_engine_class("rollout", rollout.engine)(
        model_path, platform, seed=rollout.seed, max_batch_size=rollout.max_batch_size,
        **rollout.engine_options)
    controller = build_controller(settings, InProcessRuntime(engine), run.train_set,
                                  run.eval_set, decode=run.decode, reward=run.reward)
    controller.idle = None  # nothing trains here: no warning about training
    shown: list[dict[str, Any]] = []
    controller.on_samples = lambda version, groups: shown.extend(
        sample_rows(groups, run.decode, show))

    async def evaluate() -> dict[str, float]:
        if weights is not None:
            await engine.load_weights(engine.version, [weights])
        return await controller.evaluate()

    try:
        result = asyncio.run(evaluate())
    finally:
        run.close()
    return {**result, "eval_prompts": len(run.eval_set.prompts),
            "reward_errors": run.reward.errors, **({"samples": shown} if show else {})}


def train(config: EddyConfig, on_step: Callable[[dict[str, Any]], None] = lambda m: None,
          ) -> Path:
    """Run RL training as configured; returns the path of `summary.json`. The run directory
    is locked for the whole run (`run_dir.py`)."""
    started = time.monotonic()
    # Fail fast, in one sentence, if a platform is absent; else the names go into the run's
    # copy of the config (saved with the run, given to every worker) and the checkpoints.
    # `config` itself stays as it was loaded.
    explicit = explicit_role_platforms(config)
    config = with_role_platforms(config)
    check_memory(config)  # preflight.memory: before the run directory or anything else exists
    run_dir = resolve_run_dir(config)
    with RunDirectory.claim(run_dir) as hold:  # no second run on it while this one lives
        return _train(config, on_step, hold, started, explicit)


def _train(config: EddyConfig, on_step: Callable[[dict[str, Any]], None], hold: RunDirectory,
           started: float, explicit: dict[str, bool]) -> Path:
    run_dir = hold.path
    # Check first, then write: nothing in run_dir changes until every check has passed.
    point = resume.find(config.resume, run_dir)
    if point is None and hold.holds_run():
        # Appending would mix two runs' metrics; overwriting would lose the first run's.
        raise resume.already_holds_a_run(run_dir)
    resume.check_settings(point, seed=config.seed, steps=config.loop.steps)
    if point is not None:
        run_state.check_platforms(point.state, role_platform_names(config), explicit)
    model_path = preflight(config)  # the model's files, lengths, engines: before Ray starts
    with contextlib.ExitStack() as stack:  # whatever was started is stopped, in reverse
        run = prepare(config, model_path, hold.staging("data"))
        stack.callback(run.close)
        if point is not None:
            run_state.check_compatible(point.state, seed=config.seed,
                                       fingerprint=run.train_set.fingerprint,
                                       prompts=len(run.train_set.prompts))
        # -- every check has passed: from here on the run writes --
        hold.install("data")
        if point is not None:
            resume.begin(point, run_dir)
        else:
            hold.clear_empty_metrics()
        hold.write_text("config.yaml", to_yaml(run.config))  # with the resolved platforms
        summary = _run(run, on_step, stack, run_dir, point, started)
    summary.update(wall_seconds=time.monotonic() - started, run_dir=str(run_dir),
                   checkpoint=str(run_dir / resume.FINAL),
                   prompts_truncated=run.train_set.truncated + run.eval_set.truncated)
    return hold.write_text("summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")


def _run(run: ResolvedRun, on_step, stack: contextlib.ExitStack, run_dir: Path,
         point: resume.ResumePoint | None, started: float) -> dict[str, Any]:
    """Metrics sinks, the Ray runtime and the controller; the run itself."""
    config, reward = run.config, run.reward
    # metrics.jsonl, and TensorBoard / W&B as `observe` says (eddyrl/observability/sinks.py)
    metrics_file = open_sinks(config.observe, run_dir, dataclasses.asdict(config),
                              resumed_at=None if point is None else point.step)
    stack.callback(metrics_file.close)

    def log(metrics: dict[str, Any]) -> None:
        metrics = {**metrics, "wall_s": time.monotonic() - started}
        metrics_file(metrics)
        on_step(metrics)

    if config.runtime_kind() == "local":
        from .runtime.local import LocalRuntime

        runtime = base_runtime = LocalRuntime(run.runtime, run.model_path, str(run_dir))
    else:
        from .runtime.ray import RayRuntime

        runtime = base_runtime = RayRuntime(run.runtime, run.model_path, str(run_dir))
    stack.callback(base_runtime.shutdown)
    where = _where_actors_are(base_runtime)
    if where:  # written at once (a run that ends early still tells); the summary repeats it
        write_atomic(run_dir / "placement.json", json.dumps(where, indent=2))
    if config.observe.trace:  # every worker's activity -> trace.json; RayRuntime's clock is
        # time.monotonic, so `started` puts the trace on the same time axis as wall_s
        runtime = TracingRuntime(runtime, Trace(), config.train.num_workers, origin=started)
        reward = runtime.timed_reward(reward)
        # also after a failure: what led up to it
        stack.callback(lambda: runtime.close().write(str(run_dir / "trace.json")))
    controller = build_controller(run.settings, runtime, run.train_set, run.eval_set,
                                  decode=run.decode, reward=reward, log=log)
    if config.observe.samples:  # readable samples at each evaluation (samples.jsonl, ...)
        controller.on_samples = lambda version, groups: metrics_file.samples(
            version, sample_rows(groups, run.decode, config.observe.samples))
    # a checkpoint's write survives a lost trainer rank like a step (core/trainer_recovery.py)
    save = controller.surviving(runtime.save, "checkpoint write")
    controller.checkpoint = resume.every(config.checkpoint, controller, save, run_dir)
    if isinstance(runtime, TracingRuntime):
        controller.checkpoint = flush_at_checkpoints(
            controller.checkpoint, config.checkpoint.every, runtime.trace,
            str(run_dir / "trace.json"))
    return asyncio.run(_run_and_save(controller, runtime, run_dir, config, point))


def _where_actors_are(runtime) -> dict[str, Any]:
    """Each Ray actor's device on its node (`devices`), and on a cluster its node
    (`placement`), as they started: placement.json and the summary."""
    where: dict[str, Any] = {}
    if getattr(runtime, "placement", None):
        where["placement"] = runtime.placement
    if getattr(runtime, "devices", None):
        where["devices"] = runtime.devices
    return where


async def _run_and_save(controller: Controller, runtime, run_dir: Path, config: EddyConfig,
                        point: resume.ResumePoint | None) -> dict[str, Any]:
    requeued = []
    if point is not None:  # the trainer first: the controller publishes its weights
        await runtime.load(str(point.path))
        requeued = run_state.restore(controller, point.state)
    summary = await controller.run()
    # Rollout utilisation: time the engines spent in forward passes, all workers together.
    stats = await runtime.worker_stats()
    summary.update(runtime=config.runtime_kind(), rollout_workers=len(stats),
                   platforms=role_platform_names(config),
                   rollout_replacements=runtime.replacements
                   if isinstance(runtime, Recoverable) else 0,
                   rollout_busy_s=sum(s.busy_seconds for s in stats),
                   rollout_worker_tokens=[s.tokens_generated for s in stats])
    summary.update(_where_actors_are(getattr(runtime, "runtime", runtime)))  # (traced)
    # With the model: the ledger (which prompts were trained fresh, replayed, dropped) and
    # everything else a resume needs.
    summary["run_checkpoint"] = str(await resume.save_final(
        controller, controller.surviving(runtime.save, "checkpoint write"), run_dir,
        config.checkpoint.keep_last, point))
    return {**summary, **resume.summary(point, requeued)}

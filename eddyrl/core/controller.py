"""The RL loop. Short enough to read like the algorithm, and time-agnostic: it awaits only what
the runtime gives it and takes timestamps from `runtime.now()`, so the same loop runs on Ray and
under a simulator's virtual clock. It does no I/O; metrics go to the `log` callback.

Synchronous GRPO here: each step rolls out a batch on the current weights (staleness 0), trains
on it, and syncs the new weights to every rollout worker.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..engines.inference.base import GenerationRequest, GenerationResult, SamplingParams
from ..tasks.prompts import Prompt
from .batch import TrainBatch
from .batching import build_train_batch
from .config import AlgorithmConfig, LoopConfig
from .rewarding import SafeReward
from .trajectory import Group, Trajectory


class Runtime(Protocol):
    workers: list[Any]

    def now(self) -> float: ...
    async def generate(self, worker: int, requests: list[GenerationRequest]
                       ) -> list[GenerationResult]: ...
    async def train(self, batch: TrainBatch) -> dict[str, float]: ...
    async def sync_weights(self, version: int) -> None: ...


@dataclass
class LoopSettings:
    loop: LoopConfig
    algorithm: AlgorithmConfig
    sampling: SamplingParams
    n_samples: int
    seed: int
    pad_id: int


@dataclass
class Controller:
    runtime: Runtime
    settings: LoopSettings
    train_prompts: Any  # tasks.prompts.PromptSet
    eval_prompts: Any
    decode: Callable[[list[int]], str]
    reward: SafeReward
    log: Callable[[dict[str, Any]], None] = lambda metrics: None
    version: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    _ids: Any = field(default_factory=itertools.count)

    async def run(self) -> dict[str, Any]:
        loop = self.settings.loop
        started = self.runtime.now()
        initial = await self.evaluate()
        self._emit({"step": 0, **initial})
        batches = self.train_prompts.batches(loop.batch_prompts, self.settings.seed)
        for step in range(1, loop.steps + 1):
            metrics = await self.step(batches)
            if (loop.eval_every and step % loop.eval_every == 0) or step == loop.steps:
                metrics.update(await self.evaluate())
            self._emit({"step": step, **metrics})
        final = self.history[-1] if loop.steps else {"step": 0, **initial}
        return {"initial_eval_accuracy": initial["eval_accuracy"],
                "final_eval_accuracy": final["eval_accuracy"], "steps": loop.steps,
                "seconds": self.runtime.now() - started,
                "samples_trained": sum(m.get("samples_trained", 0) for m in self.history),
                "tokens_generated": sum(m.get("gen_tokens", 0) for m in self.history),
                "reward_errors": self.reward.errors}

    async def step(self, batches) -> dict[str, Any]:
        """Roll out one batch on the current policy, train on it, publish the new weights."""
        t0 = self.runtime.now()
        groups, rollout_metrics = await self.collect_batch(batches)
        t1 = self.runtime.now()
        if not groups:  # every group uninformative: nothing to learn from this step
            return {**rollout_metrics, "rollout_s": t1 - t0, "skipped": 1}
        batch = build_train_batch(groups, self.settings.pad_id,
                                  normalize_std=self.settings.algorithm.normalize_std)
        train_metrics = await self.runtime.train(batch)
        t2 = self.runtime.now()
        self.version += 1
        await self.runtime.sync_weights(self.version)
        t3 = self.runtime.now()
        tokens = train_metrics.pop("mismatch_tokens", 0.0) or 1.0
        train_metrics["mismatch_abs_mean"] = train_metrics.pop("mismatch_abs_sum", 0.0) / tokens
        return {**rollout_metrics, **train_metrics, "version": self.version,
                "samples_trained": len(batch), "rollout_s": t1 - t0, "train_s": t2 - t1,
                "sync_s": t3 - t2, "step_s": t3 - t0,
                "tokens_per_s": rollout_metrics["gen_tokens"] / max(t1 - t0, 1e-9)}

    async def collect_batch(self, batches) -> tuple[list[Group], dict[str, Any]]:
        """A batch of groups; with dynamic sampling, uninformative groups are dropped and
        refilled from new prompts for up to `max_refill_rounds` extra rounds."""
        algo, want = self.settings.algorithm, self.settings.loop.batch_prompts
        kept: list[Group] = []
        generated: list[Group] = []
        rounds = 1 + (algo.max_refill_rounds if algo.dynamic_sampling else 0)
        for _ in range(rounds):
            groups = await self.rollout(next(batches)[:want - len(kept)],
                                        self.settings.n_samples, self.settings.sampling)
            generated += groups
            kept += [g for g in groups if g.is_informative()] if algo.dynamic_sampling else groups
            if len(kept) >= want:
                break
        trajectories = [t for g in generated for t in g.trajectories]
        rewards = [t.reward for t in trajectories]
        lengths = [t.num_tokens for t in trajectories]
        return kept[:want], {
            "reward_mean": sum(rewards) / len(rewards),
            "train_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "response_len_mean": sum(lengths) / len(lengths),
            "response_len_max": max(lengths), "gen_tokens": sum(lengths),
            "groups_generated": len(generated), "groups_kept": min(len(kept), want),
            "reward_errors": self.reward.errors}

    async def rollout(self, prompts: list[Prompt], n: int, sampling: SamplingParams
                      ) -> list[Group]:
        """Generate `n` responses per prompt, spread over the workers group by group, and score
        each response as soon as its worker returns."""
        groups = [Group(f"g{next(self._ids)}", p.prompt, p.answer, list(p.prompt_ids),
                        self.version) for p in prompts]
        per_worker: list[list[GenerationRequest]] = [[] for _ in self.runtime.workers]
        owner: dict[str, Group] = {}
        for index, group in enumerate(groups):
            for sample in range(n):
                request_id = f"{group.group_id}-{sample}"
                owner[request_id] = group
                per_worker[index % len(per_worker)].append(
                    GenerationRequest(request_id, group.prompt_ids, sampling))
        calls = [self.runtime.generate(w, reqs) for w, reqs in enumerate(per_worker) if reqs]
        for finished in asyncio.as_completed(calls):
            for result in await finished:
                group = owner[result.request_id]
                reward, error = self.reward(self.decode(result.token_ids), group.answer)
                group.trajectories.append(Trajectory(result, reward, error))
        for group in groups:  # a fixed order inside each group, whatever the completion order
            group.trajectories.sort(key=lambda t: int(t.result.request_id.rsplit("-", 1)[1]))
        return groups

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: one response per held-out prompt at `loop.eval_temperature`."""
        sampling = SamplingParams(**{**vars_of(self.settings.sampling),
                                     "temperature": self.settings.loop.eval_temperature})
        groups = await self.rollout(self.eval_prompts.prompts, 1, sampling)
        rewards = [g.trajectories[0].reward for g in groups]
        return {"eval_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
                "eval_reward_mean": sum(rewards) / len(rewards)}

    def _emit(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        self.log(metrics)


def vars_of(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__slots__}

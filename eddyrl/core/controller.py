"""The RL loop. Short enough to read like the algorithm, and time-agnostic: it awaits only what
the runtime gives it and takes timestamps from `runtime.now()`, so the same loop runs on Ray and
under a simulator's virtual clock. It does no I/O; metrics go to the `log` callback.

Each step trains on the oldest fresh batch that the version window admitted (staleness <= K;
K = 0 is synchronous GRPO on the current weights), plus replayed groups (ReFlow's replay cycle:
at most floor(sigma*B), weighted tau, lag <= delta), then publishes the new weights to every
rollout worker. The ledger records every group's lifecycle: the proof that each prompt was
trained exactly once as fresh data.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from ..engines.inference.base import GenerationRequest, GenerationResult, SamplingParams
from ..tasks.prompts import Prompt
from .batch import TrainBatch
from .batching import build_train_batch
from .config import AlgorithmConfig, LoopConfig
from .ledger import Ledger
from .replay import ReplayBuffer, ReplayConfig
from .rewarding import SafeReward
from .trajectory import Group, Trajectory
from .version_window import VersionWindow


class Runtime(Protocol):
    workers: list[Any]

    def now(self) -> float: ...
    def generate(self, worker: int, requests: list[GenerationRequest]
                 ) -> AsyncIterator[GenerationResult]: ...
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
    replay: ReplayConfig = field(default_factory=ReplayConfig)


@dataclass
class Controller:
    runtime: Runtime
    settings: LoopSettings
    train_prompts: Any  # tasks.prompts.PromptSet
    eval_prompts: Any
    decode: Callable[[list[int]], str]
    reward: SafeReward
    log: Callable[[dict[str, Any]], None] = lambda metrics: None
    history: list[dict[str, Any]] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    _ids: Any = field(default_factory=itertools.count)
    _pending: deque = field(default_factory=deque)  # (epoch, prompt) drawn, not yet rolled out

    def __post_init__(self) -> None:
        loop, algo = self.settings.loop, self.settings.algorithm
        self.replay = ReplayBuffer(self.settings.replay)
        # Fresh groups per step: the batch less the replay slots (ReFlow: (1 - sigma) * B).
        self.fresh_per_step = loop.batch_prompts - self.replay.replay_slots(loop.batch_prompts)
        # Admission bounds staleness to K: at most K batches are generated ahead of training.
        self.window = VersionWindow(max_staleness=algo.max_staleness,
                                    batch_groups=self.fresh_per_step,
                                    max_concurrent=(algo.max_staleness + 1) * loop.batch_prompts)
        self._inflight: deque[asyncio.Future] = deque()  # fresh batches, in dispatch order
        self._batches = self.train_prompts.batches(loop.batch_prompts, self.settings.seed)

    @property
    def version(self) -> int:
        """The trainer's policy version: the number of training steps taken."""
        return self.window.version

    async def run(self) -> dict[str, Any]:
        loop = self.settings.loop
        started = self.runtime.now()
        initial = await self.evaluate()
        self._emit({"step": 0, **initial})
        step = 0
        for step in range(1, loop.steps + 1):
            self.ledger.step = step
            metrics = await self.step()
            out_of_time = bool(loop.max_seconds) and \
                self.runtime.now() - started >= loop.max_seconds
            if (loop.eval_every and step % loop.eval_every == 0) or step == loop.steps \
                    or out_of_time:
                metrics.update(await self.evaluate())
            self._emit({"step": step, **metrics})
            if out_of_time:
                break
        await self._drain_pipeline()
        final = self.history[-1] if step else {"step": 0, **initial}
        return {"initial_eval_accuracy": initial["eval_accuracy"],
                "final_eval_accuracy": final["eval_accuracy"], "steps": step,
                "seconds": self.runtime.now() - started,
                "samples_trained": sum(m.get("samples_trained", 0) for m in self.history),
                "tokens_generated": sum(m.get("gen_tokens", 0) for m in self.history),
                "replayed_samples": sum(m.get("replay_samples", 0) for m in self.history),
                "reward_errors": self.reward.errors,
                "ledger": {state.value: n for state, n in self.ledger.counts().items()}}

    async def step(self) -> dict[str, Any]:
        """Take the oldest fresh batch (waiting for it: `rollout_s`), add replayed groups, train,
        publish the new weights. A step whose groups all carry no signal trains nothing but
        still advances the version, so the window admits the next batch."""
        t0 = self.runtime.now()
        want = self.settings.loop.batch_prompts
        replayed = self.replay.select(want, self.version)
        fresh, rollout_metrics = await self.collect_fresh()
        t1 = self.runtime.now()
        lags = [self.version - t.result.versions[0]  # trainer - behaviour version, per sample
                for g in fresh for t in g.trajectories if t.result.versions]
        groups = fresh + [group for group, _ in replayed]
        train_metrics: dict[str, float] = {}
        if groups:
            weights = [1.0] * len(fresh) + [weight for _, weight in replayed]
            batch = build_train_batch(groups, self.settings.pad_id, weights=weights,
                                      normalize_std=self.settings.algorithm.normalize_std)
            train_metrics = await self.runtime.train(batch)
        t2 = self.runtime.now()
        self.window.advance()
        await self.runtime.sync_weights(self.version)
        t3 = self.runtime.now()
        self._after_training(fresh, [group for group, _ in replayed])
        tokens = train_metrics.pop("mismatch_tokens", 0.0) or 1.0
        train_metrics["mismatch_abs_mean"] = train_metrics.pop("mismatch_abs_sum", 0.0) / tokens
        replay_samples = sum(len(g.trajectories) for g, _ in replayed)
        return {**rollout_metrics, **train_metrics, "version": self.version,
                "groups_kept": len(fresh), "staleness_mean": sum(lags) / max(len(lags), 1),
                "staleness_max": max(lags, default=0),
                "samples_trained": sum(len(g.trajectories) for g in groups),
                "replay_samples": replay_samples, "skipped": int(not groups),
                "replay_fraction": len(replayed) / max(len(groups), 1),
                "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0,
                "tokens_per_s": rollout_metrics["gen_tokens"] / max(t1 - t0, 1e-9)}

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

    def _next_prompts(self, count: int) -> list[tuple[int, Prompt]]:
        """The next `count` (epoch, prompt) pairs; drawn prompts are never skipped."""
        while len(self._pending) < count:
            epoch, prompts = next(self._batches)
            self._pending.extend((epoch, prompt) for prompt in prompts)
        return [self._pending.popleft() for _ in range(count)]

    def _fill_pipeline(self) -> None:
        """Dispatch whole fresh batches while the version window admits them: one at a time
        with K = 0 (synchronous), up to K + 1 ahead of training otherwise."""
        size = self.fresh_per_step
        while size and self.window.capacity() >= size:
            drawn = self._next_prompts(size)
            groups = self._new_groups([prompt for _, prompt in drawn])
            for group, (epoch, prompt) in zip(groups, drawn):
                group.dispatch_version = self.window.dispatch(group.group_id)
                self.ledger.queue(group.group_id, prompt.index, epoch)
            self._inflight.append(asyncio.ensure_future(self._generate(
                groups, self.settings.n_samples, self.settings.sampling, track=True)))

    async def _drain_pipeline(self) -> None:
        """Batches still generating when training ends finish (collected, never trained)."""
        while self._inflight:
            await self._inflight.popleft()

    async def collect_fresh(self) -> tuple[list[Group], dict[str, Any]]:
        """The oldest dispatched fresh batch (C3: its staleness is checked against K); with
        dynamic sampling, uninformative groups are dropped (recorded as evicted) and, in
        synchronous mode, refilled from new prompts for up to `max_refill_rounds`."""
        algo = self.settings.algorithm
        self._fill_pipeline()
        if not self._inflight:
            return [], _rollout_metrics([], self.reward.errors)
        generated = await self._inflight.popleft()
        taken = self.window.take_batch()  # checks C3 for every group it hands out
        assert taken == [g.group_id for g in generated], "batches must train in dispatch order"
        kept = self._drop_uninformative(generated)
        for _ in range(algo.max_refill_rounds if algo.dynamic_sampling else 0):
            if len(kept) >= self.fresh_per_step:
                break
            drawn = self._next_prompts(self.fresh_per_step - len(kept))
            groups = self._new_groups([prompt for _, prompt in drawn])
            for group, (epoch, prompt) in zip(groups, drawn):
                self.ledger.queue(group.group_id, prompt.index, epoch)
            await self._generate(groups, self.settings.n_samples, self.settings.sampling,
                                 track=True)
            generated += groups
            kept += self._drop_uninformative(groups)
        return kept, _rollout_metrics(generated, self.reward.errors)

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

    async def _generate(self, groups: list[Group], n: int, sampling: SamplingParams,
                        track: bool = False) -> list[Group]:
        """Generate `n` responses per group, spread over the workers group by group, and score
        each response as soon as its worker returns. Tracked (training) groups are recorded in
        the ledger and the version window; evaluation groups are not."""
        per_worker: list[list[GenerationRequest]] = [[] for _ in self.runtime.workers]
        owner: dict[str, Group] = {}
        for index, group in enumerate(groups):
            if track:
                self.ledger.start(group.group_id, index % len(per_worker),
                                  group.dispatch_version)
            for sample in range(n):
                request_id = f"{group.group_id}-{sample}"
                owner[request_id] = group
                per_worker[index % len(per_worker)].append(
                    GenerationRequest(request_id, group.prompt_ids, sampling))

        async def score(worker: int, requests: list[GenerationRequest]) -> None:
            # Rewards stream: each trajectory is scored as soon as it finishes, while the
            # long tail of its batch is still generating.
            async for result in self.runtime.generate(worker, requests):
                group = owner[result.request_id]
                reward, error = self.reward(self.decode(result.token_ids), group.answer)
                group.trajectories.append(Trajectory(result, reward, error))

        await asyncio.gather(*(score(w, reqs) for w, reqs in enumerate(per_worker) if reqs))
        for group in groups:  # a fixed order inside each group, whatever the completion order
            group.trajectories.sort(key=lambda t: int(t.result.request_id.rsplit("-", 1)[1]))
            if track:
                self.ledger.collect(group.group_id)
                if self.window.is_running(group.group_id):
                    self.window.collect(group.group_id)
        return groups

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: one response per held-out prompt at `loop.eval_temperature`."""
        sampling = SamplingParams(**{**vars_of(self.settings.sampling),
                                     "temperature": self.settings.loop.eval_temperature})
        groups = await self._generate(self._new_groups(self.eval_prompts.prompts), 1, sampling)
        rewards = [g.trajectories[0].reward for g in groups]
        return {"eval_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
                "eval_reward_mean": sum(rewards) / len(rewards)}

    def _emit(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        self.log(metrics)


def vars_of(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__slots__}


def _rollout_metrics(groups: list[Group], reward_errors: int) -> dict[str, Any]:
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajectories] or [0.0]
    lengths = [t.num_tokens for t in trajectories] or [0]
    return {"reward_mean": sum(rewards) / len(rewards),
            "train_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "response_len_mean": sum(lengths) / len(lengths),
            "response_len_max": max(lengths), "gen_tokens": sum(lengths),
            "groups_generated": len(groups), "reward_errors": reward_errors}

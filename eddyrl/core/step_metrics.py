"""What a step reports: the groups it generated and trained, how the rollout's counters grew
over it, and its timings; and what a held-out evaluation reports.

With several rewards (`data.rewards`) a sample's reward is their weighted sum; each one's own
mean is reported beside it (`reward/<name>`, `eval_reward/<name>`), and accuracy counts the
first listed (the correctness reward) reaching 1. With one reward function nothing is added.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ..protocol import Group, Trajectory

if TYPE_CHECKING:  # annotations only: the metrics stay a leaf below the rollout
    from .rollout import StreamingRollout


def counters_since(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters' growth since `before` (environment statistics of one step)."""
    return {name: value - before.get(name, 0.0) for name, value in now.items()}


def rollout_metrics(groups: list[Group], reward_errors: int) -> dict[str, Any]:
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajectories] or [0.0]
    lengths = [t.num_tokens for t in trajectories] or [0]  # environment tokens included
    prompts = [len(t.result.prompt_ids) for t in trajectories] or [0]
    return {"reward_mean": sum(rewards) / len(rewards),
            "train_accuracy": accuracy(trajectories),
            **reward_part_means(trajectories, "reward/"),
            "response_len_mean": sum(lengths) / len(lengths),
            "response_len_max": max(lengths),
            "gen_tokens": sum(t.num_generated for t in trajectories),
            "prompt_len_mean": sum(prompts) / len(prompts),
            "groups_generated": len(groups), "reward_errors": reward_errors}


def eval_metrics(groups: list[Group]) -> dict[str, float]:
    """Held-out accuracy and mean reward of each group's one response."""
    trajectories = [g.trajectories[0] for g in groups]
    rewards = [t.reward for t in trajectories]
    return {"eval_accuracy": accuracy(trajectories),
            "eval_reward_mean": sum(rewards) / len(rewards),
            **reward_part_means(trajectories, "eval_reward/")}


def is_correct(trajectory: Trajectory) -> bool:
    """The sample's reward, or with several the first listed's, is 1 (or more)."""
    parts = trajectory.reward_parts
    return (next(iter(parts.values())) if parts else trajectory.reward) >= 1.0


def accuracy(trajectories: list[Trajectory]) -> float:
    return sum(map(is_correct, trajectories)) / max(len(trajectories), 1)


def reward_part_means(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """Each named reward's mean as `<prefix><name>`, over the samples scored with it (an
    environment's reward has no parts); {} with one reward function."""
    values: dict[str, list[float]] = {}
    for trajectory in trajectories:
        for name, value in (trajectory.reward_parts or {}).items():
            values.setdefault(name, []).append(value)
    return {f"{prefix}{name}": sum(seen) / len(seen) for name, seen in values.items()}


@dataclass(frozen=True, slots=True)
class RolloutCounters:
    """The streaming rollout's running totals, read at once: a step takes one at its start and
    reports `since` it at its end (environment statistics included, multi-turn only)."""

    migrated: int = 0  # requests moved between workers
    restarted: int = 0  # trajectories regenerated because their version's weights were gone
    workers_lost: int = 0
    regenerated: int = 0  # requests regenerated because their worker was lost
    routed: int = 0  # of `migrated`: moved by the bucket router to another bucket
    env: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, rollout: StreamingRollout) -> RolloutCounters:
        env = rollout.episodes.stats.metrics()
        return cls(rollout.migrated, rollout.restarted, rollout.workers_lost,
                   rollout.regenerated, rollout.routed, tuple(env.items()))

    def since(self, before: RolloutCounters) -> dict[str, float]:
        names = {"migrated": "migrated_requests", "restarted": "restarted_requests",
                 "workers_lost": "workers_lost", "regenerated": "regenerated_requests",
                 "routed": "routed_requests"}
        grown = {names[f.name]: getattr(self, f.name) - getattr(before, f.name)
                 for f in fields(self) if f.name in names}
        return {**counters_since(dict(self.env), dict(before.env)), **grown}


def step_record(version: int, fresh: list[Group], replayed: list[tuple[Group, float]],
                generated: dict[str, Any], train: dict[str, float], inflight: int,
                times: tuple[float, float, float, float]) -> dict[str, Any]:
    """One step's metrics: `generated` (`rollout_metrics` of the groups the rollout handed
    out), the trainer's, and the wait for the batch (t0..t1), training
    (..t2) and the weight sync (..t3)."""
    t0, t1, t2, t3 = times
    train = dict(train)
    tokens = train.pop("mismatch_tokens", 0.0) or 1.0
    train["mismatch_abs_mean"] = train.pop("mismatch_abs_sum", 0.0) / tokens
    lags = [version - 1 - t.result.versions[0]  # trainer - behaviour version, per sample
            for g in fresh for t in g.trajectories if t.result.versions]
    groups = len(fresh) + len(replayed)
    return {**generated, **train, "version": version,
            "groups_kept": len(fresh), "staleness_mean": sum(lags) / max(len(lags), 1),
            "staleness_max": max(lags, default=0),
            # per-sample lags as counts, for `eddy report`'s staleness histogram
            "staleness_counts": {str(lag): lags.count(lag) for lag in sorted(set(lags))},
            "samples_trained": sum(len(g.trajectories) for g in fresh) +
            sum(len(g.trajectories) for g, _ in replayed),
            "replay_samples": sum(len(g.trajectories) for g, _ in replayed),
            "skipped": int(not groups), "replay_fraction": len(replayed) / max(groups, 1),
            "inflight_groups": inflight,
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0,
            # tokens of this step's batch over the step's wall time: with rollout running
            # ahead, the wait for the batch (rollout_s) can be ~0 and says nothing of speed
            "tokens_per_s": generated["gen_tokens"] / max(t3 - t0, 1e-9)}

"""The policies the simulator compares, as settings of one run: each is a set of config
overrides over the scenario, and every policy sets every dimension it touches (staleness,
partial rollout, migration, legacy fill, replay, routing), so a scenario's own choices do not
leak into the comparison.
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import EddyConfig, load_config
from ..errors import ConfigError

_BASE = ["algorithm.max_staleness=0", "rollout.partial_rollout=false", "rollout.migrate=false",
         "rollout.fill_legacy=false", "replay.max_fraction=0", "routing.policy=none",
         "algorithm.max_refill_rounds=0"]
_REPLAY = ["replay.max_fraction=0.25", "replay.loss_weight=0.5"]


def _bucket(config: EddyConfig) -> list[str]:
    """Libra's router over the scenario's instances: three quarters in a short bucket sized for
    twice the mean response, the rest in a long one; milestones at half, one and two means."""
    instances, workload = config.sim.rollout.groups, config.sim.workload
    if instances < 2:
        raise ConfigError(f"policy 'bucket' needs at least 2 rollout instances; the scenario "
                          f"has {instances}")
    short = max(1, min(instances - 1, round(0.75 * instances)))
    mean, longest = workload.mean_response_tokens, workload.max_response_tokens
    short_tokens = min(int(2 * mean), longest - 1)
    milestones = sorted({max(1, int(mean / 2)), int(mean), int(2 * mean)})
    return ["routing.policy=bucket", f"routing.milestones=[{','.join(map(str, milestones))}]",
            "routing.min_observations=8", "routing.rebuild_every=64",
            f"routing.buckets=[{{name: short, max_tokens: {short_tokens}, workers: {short}}}, "
            f"{{name: long, max_tokens: {longest}, workers: {instances - short}}}]"]


POLICIES: dict[str, Callable[[EddyConfig], list[str]]] = {
    "sync": lambda c: [],
    "one_step": lambda c: ["algorithm.max_staleness=1"],
    "partial": lambda c: ["algorithm.max_staleness=1", "rollout.partial_rollout=true"],
    "async": lambda c: ["algorithm.max_staleness=3"],
    "multiversion": lambda c: ["algorithm.max_staleness=3", "rollout.migrate=true",
                               "rollout.fill_legacy=true"],
    "replay": lambda c: ["algorithm.max_staleness=1", *_REPLAY, "replay.max_lag=2"],
    "bucket": lambda c: ["algorithm.max_staleness=1", *_bucket(c)],
    "all": lambda c: ["algorithm.max_staleness=3", "rollout.migrate=true",
                      "rollout.fill_legacy=true", *_REPLAY, "replay.max_lag=4", *_bucket(c)],
}


def policy_config(scenario: str | None, overrides: list[str], policy: str) -> EddyConfig:
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    base = load_config(scenario, overrides)
    return load_config(scenario, [*overrides, *_BASE, *POLICIES[policy](base)])


def compare(scenario: str | None, overrides: list[str], policies: list[str],
            on_done: Callable[[str, dict[str, Any]], None] = lambda p, r: None
            ) -> dict[str, dict[str, Any]]:
    """Each policy simulated on the scenario, one after another; a row of numbers each."""
    from .sim import simulate

    rows: dict[str, dict[str, Any]] = {}
    for policy in policies:
        summary = simulate(policy_config(scenario, overrides, policy))
        rows[policy] = row(summary)
        on_done(policy, rows[policy])
    sync = rows.get("sync")
    for values in rows.values():
        values["speedup"] = (values["tokens_per_s"] / sync["tokens_per_s"]
                             if sync and sync["tokens_per_s"] else None)
    return rows


def row(summary: dict[str, Any]) -> dict[str, Any]:
    steps = [m for m in summary["history"] if m.get("step", 0) > 0]
    # time from the first step's start to the last step's end: the initial evaluation is not
    # part of the training pipeline's throughput
    span = sum(m["step_s"] for m in steps)
    lags = [m["staleness_max"] for m in steps]
    return {
        "steps": len(steps), "step_s": span / max(len(steps), 1),
        "tokens_per_s": sum(m["gen_tokens"] for m in steps) / max(span, 1e-12),
        "samples_per_s": sum(m["samples_trained"] for m in steps) / max(span, 1e-12),
        "rollout_idle": summary["rollout_idle"], "train_idle": summary["train_idle"],
        "staleness_mean": sum(m["staleness_mean"] for m in steps) / max(len(steps), 1),
        "staleness_max": max(lags, default=0),
        "replay_fraction": sum(m["replay_fraction"] for m in steps) / max(len(steps), 1),
        "migrated": sum(m["migrated_requests"] for m in steps),
        "preemptions": summary["preemptions"],
        "cpu_per_step_s": summary["cpu_s"] / max(len(steps), 1),
        "cpu_fraction": summary["cpu_per_step_fraction"],
        "wall_s": summary["wall_s"],
    }

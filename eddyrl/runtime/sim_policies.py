"""The policies the simulator compares, as settings of one run: each is a set of config
overrides over the scenario, and every policy sets every dimension it touches (staleness,
partial rollout, migration, legacy fill, replay, routing), so a scenario's own choices do not
leak into the comparison.

- sync: K = 0, the roles on their own devices (the scenario's split). colocated: K = 0 with
  every device time-shared by both roles (verl's hybrid engine): generation and training each
  get all of the scenario's devices, in turns.
- one_step: K = 1 with one batch in flight (textbook one-step off-policy: the
  next batch generates while the current one trains).
- partial: K = 1 with partial rollout (new weights reach running generations).
- async: K = 3 with partial rollout and streaming refill (AReaL-style: interruptible
  generation, bounded staleness, prompts topped up as groups finish).
- multiversion: K = 3, one version per trajectory, consolidation and legacy fill, prompts
  topped up as groups finish (DORA; its rollout batch is everything the window admits).
- replay: K = 1 with ReFlow's replay (sigma 0.25, tau 0.5). bucket: K = 1 with Libra's router
  (a long bucket of instances twice as wide).
- elastic: K = 1 with the elastic pool and the adaptive scheduler (workers lent to training
  when training is the bottleneck, each move paying the scenario's cold start).
- all: multiversion + replay + bucket.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..config import EddyConfig, load_config
from ..engines.inference.sim import default_kv_capacity
from ..scheduler.cost_model import CostModel
from ..errors import ConfigError

_BASE = ["cluster.placement=split", "elastic.enabled=false", "adaptive.enabled=false",
         "algorithm.max_staleness=0", "rollout.partial_rollout=false", "rollout.migrate=true",
         "rollout.fill_legacy=false", "replay.max_fraction=0", "routing.policy=none",
         "algorithm.max_refill_rounds=0", "loop.refill=batch", "loop.max_inflight_prompts=0"]
_STREAM = ["loop.refill=stream"]
_REPLAY = ["replay.max_fraction=0.25", "replay.loss_weight=0.5"]


def _bucket(config: EddyConfig) -> list[str]:
    """Libra's router over the scenario's rollout devices: a short bucket sized for twice the
    mean response and a long one whose instances are twice as wide (tensor parallel), each
    bucket given devices in proportion to the share of tokens the workload's length
    distribution puts in it (log-normal: the responses longer than t hold
    Phi((mu + sigma^2 - ln t) / sigma) of all tokens); milestones at half, one and two means.
    The long bucket's batch is sized to its KV cache at its expected context."""
    rollout, workload = config.sim.rollout, config.sim.workload
    wide = 2 * rollout.tp
    if rollout.devices < rollout.tp + wide:
        raise ConfigError(f"policy 'bucket' needs room for a short instance (tp {rollout.tp}) "
                          f"and a long one (tp {wide}); the scenario has "
                          f"{rollout.devices} rollout devices")
    mean, longest = workload.mean_response_tokens, workload.max_response_tokens
    short_tokens = min(int(2 * mean), longest - 1)
    sigma = max(workload.length_sigma, 1e-6)
    mu = math.log(mean) - sigma ** 2 / 2
    long_share = 0.5 * math.erfc(-(mu + sigma ** 2 - math.log(short_tokens)) / sigma
                                 / math.sqrt(2))
    long = max(1, min((rollout.devices - rollout.tp) // wide,
                      round(rollout.devices * long_share / wide)))
    short = (rollout.devices - long * wide) // rollout.tp
    longer_than_t = 0.5 * math.erfc(-(mu - math.log(short_tokens)) / sigma / math.sqrt(2))
    expected_long = mean * long_share / max(longer_than_t, 1e-9) + workload.prompt_tokens
    cost = CostModel(rollout.accelerator, config.sim.model, tp=wide)
    long_batch = max(1, min(rollout.max_batch_size,
                            int(default_kv_capacity(cost) // expected_long)))
    milestones = sorted({max(1, int(mean / 2)), int(mean), int(2 * mean)})
    return ["routing.policy=bucket", f"rollout.num_workers={short + long}",
            f"routing.milestones=[{','.join(map(str, milestones))}]",
            "routing.min_observations=8", "routing.rebuild_every=64",
            f"routing.buckets=[{{name: short, max_tokens: {short_tokens}, workers: {short}}}, "
            f"{{name: long, max_tokens: {longest}, workers: {long}, parallelism: {wide}, "
            f"max_batch_size: {long_batch}}}]"]


def _colocated(config: EddyConfig) -> list[str]:
    """Both roles on all of the scenario's devices (rollout's and training's together)."""
    sim = config.sim
    if sim.rollout.accelerator != sim.train.accelerator:
        raise ConfigError(f"policy 'colocated' time-shares devices, but the scenario's rollout "
                          f"runs on {sim.rollout.accelerator} and training on "
                          f"{sim.train.accelerator}")
    devices = sim.rollout.devices + sim.train.devices
    return ["cluster.placement=colocated", f"sim.rollout.devices={devices}",
            f"sim.train.devices={devices}"]


# the synchronous baselines a speed-up is measured against (the faster one present)
SYNC_BASELINES = ("sync", "colocated")

POLICIES: dict[str, Callable[[EddyConfig], list[str]]] = {
    "sync": lambda c: [],
    "colocated": _colocated,
    "one_step": lambda c: ["algorithm.max_staleness=1",
                           f"loop.max_inflight_prompts={c.loop.batch_prompts}"],
    "partial": lambda c: ["algorithm.max_staleness=1", "rollout.partial_rollout=true"],
    "async": lambda c: ["algorithm.max_staleness=3", "rollout.partial_rollout=true", *_STREAM],
    "multiversion": lambda c: ["algorithm.max_staleness=3", "rollout.fill_legacy=true",
                               *_STREAM],
    "replay": lambda c: ["algorithm.max_staleness=1", *_REPLAY, "replay.max_lag=2"],
    "bucket": lambda c: ["algorithm.max_staleness=1", *_bucket(c)],
    "elastic": lambda c: ["algorithm.max_staleness=1", "elastic.enabled=true",
                          "adaptive.enabled=true", "adaptive.window=2",
                          "adaptive.cooldown_steps=2"],
    "all": lambda c: ["algorithm.max_staleness=3", "rollout.fill_legacy=true", *_STREAM,
                      *_REPLAY, "replay.max_lag=4", *_bucket(c)],
}


def policy_config(scenario: str | None, overrides: list[str], policy: str) -> EddyConfig:
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    base = load_config(scenario, overrides)
    return load_config(scenario, [*overrides, *_BASE, *POLICIES[policy](base)])


def compare(scenario: str | None, overrides: list[str], policies: list[str],
            on_done: Callable[[str, dict[str, Any]], None] = lambda p, r: None,
            timelines: str | None = None) -> dict[str, dict[str, Any]]:
    """Each policy simulated on the scenario, one after another; a row of numbers each. With
    `timelines` (a folder), each policy's worker timeline is plotted there."""
    from .sim import simulate

    rows: dict[str, dict[str, Any]] = {}
    for policy in policies:
        png = f"{timelines}/timeline_{policy}.png" if timelines else None
        summary = simulate(policy_config(scenario, overrides, policy), timeline_png=png)
        rows[policy] = row(summary)
        on_done(policy, rows[policy])
    # trained samples per second, against the faster synchronous baseline run
    baseline = max((rows[p]["samples_per_s"] for p in SYNC_BASELINES if p in rows),
                   default=0.0)
    for values in rows.values():
        values["speedup"] = values["samples_per_s"] / baseline if baseline else None
    return rows


def row(summary: dict[str, Any]) -> dict[str, Any]:
    """A policy's numbers over its steady steps: every step but the first, which fills the
    pipeline (K + 1 batches start at once) and would favour sync in a short run."""
    steps = [m for m in summary["history"] if m.get("step", 0) > 0]
    steady = steps[1:] or steps
    span = sum(m["step_s"] for m in steady)
    return {
        "steps": len(steps), "step_s": span / max(len(steady), 1),
        "tokens_per_s": sum(m["gen_tokens"] for m in steady) / max(span, 1e-12),
        "samples_per_s": sum(m["samples_trained"] for m in steady) / max(span, 1e-12),
        # idle over the same steady steps (the whole run's, with its start-up evaluation and
        # the drain of groups still generating at the end, is in the simulate() summary)
        "rollout_idle": summary["rollout_idle_steady"], "train_idle": summary["train_idle_steady"],
        "device_idle": summary["device_idle_steady"], "devices": summary["devices"],
        "staleness_mean": sum(m["staleness_mean"] for m in steady) / max(len(steady), 1),
        "staleness_max": max((m["staleness_max"] for m in steps), default=0),
        "replay_fraction": sum(m["replay_fraction"] for m in steady) / max(len(steady), 1),
        "migrated": sum(m["migrated_requests"] for m in steps),
        "preemptions": summary["preemptions"],
        "cpu_per_step_s": summary["cpu_s"] / max(len(steps), 1),
        "cpu_fraction": summary["cpu_per_step_fraction"],
        "wall_s": summary["wall_s"],
    }


def plot(rows: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """Speed-up over the synchronous baseline and idle ratio by role, one bar group per
    policy (needs matplotlib: the `plots` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, (speed, idle) = plt.subplots(1, 2, figsize=(11, 4))
    speed.bar(names, [rows[n]["speedup"] or 0.0 for n in names], color="tab:blue")
    speed.axhline(1.0, color="gray", linewidth=0.8)
    speed.set_ylabel("trained samples/s vs synchronous")
    width = 0.27
    positions = range(len(names))
    for shift, key, label in [(-1, "device_idle", "all devices"), (0, "rollout_idle", "rollout"),
                              (1, "train_idle", "train")]:
        idle.bar([p + shift * width for p in positions], [rows[n][key] for n in names],
                 width, label=label)
    idle.set_xticks(list(positions), names)
    idle.set_ylabel("idle fraction")
    idle.legend()
    for axis in (speed, idle):
        axis.tick_params(axis="x", rotation=45)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

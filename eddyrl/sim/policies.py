"""The policies the simulator compares are the training modes of the mode registry
(`eddyrl/modes.py`), by the same names and with the same settings as a real run's mode file:
a policy's config is the scenario, then the registry's `BASE` (every dimension some mode sets,
at its default, so a scenario's own choices do not leak into the comparison), then the mode's
own overrides, then, only here, the mode's named scenario hook: what depends on the scenario's
cluster and workload (`SCENARIO_HOOKS` in the registry says what each sets; this module
computes them).

- colocated_devices: both roles get all of the scenario's devices, in turns (the whole batch
  trained in one part).
- partial_window: the scenario's K (at least 1) and `sim.staleness_threshold` of a batch ahead
  (verl's partial rollout; the recipe is Meituan's, as is DORA, whose paper compares against
  partial rollout), bounded as the system the scenario reproduces bounds it
  (`sim.reproduces`, `_partial_window`).
- areal_window: on a scenario that reproduces AReaL, its own K and groups in flight
  (max_head_offpolicyness, max_concurrent_rollouts) for `async`.
- scenario_workers: the scenario's rollout workers, one per instance.
- bucket_layout (bucket_layout_unsized): Libra's buckets over the scenario's rollout devices,
  sized by the decode work its length distribution puts in each (`_bucket`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import modes
from ..config.loader import RENAMED
from ..errors import ConfigError
from ..scheduler.cost_model import CostModel
from .config import SimRunConfig, load_scenario
from .engine import default_kv_capacity
from .workload import ResponseLengths

if TYPE_CHECKING:
    from ..config import EddyConfig


def _bucket(config: EddyConfig, sized: bool = True) -> list[str]:
    """Libra's router over the scenario's rollout devices: a short bucket sized for twice the
    mean response and a long one whose instances are twice as wide (tensor parallel), each
    bucket given devices in proportion to the decode work the workload's length distribution
    puts in it (`_long_work_share`); milestones at half, one and two means. With `sized`, the
    long bucket's batch is sized to its KV cache at its expected context (the adaptive
    scheduler's plans set one batch size for every worker, so `all_elastic` leaves it out).
    The router itself (`routing.policy`, `min_observations`, `window`) is the mode's own."""
    rollout, workload = config.sim.rollout, config.sim.workload
    wide = 2 * rollout.tp
    if rollout.devices < rollout.tp + wide:
        raise ConfigError(f"policy 'bucket' needs room for a short instance (tp {rollout.tp}) "
                          f"and a long one (tp {wide}); the scenario has "
                          f"{rollout.devices} rollout devices")
    mean, longest = workload.mean_response_tokens, workload.max_response_tokens
    short_tokens = min(int(2 * mean), longest - 1)
    lengths = ResponseLengths(mean, max(workload.length_sigma, 1e-6), longest)
    cost = CostModel(rollout.accelerator, config.sim.model, tp=wide)
    share = _long_work_share(lengths, short_tokens, cost, rollout.max_batch_size,
                             workload.prompt_tokens)
    long = max(1, min((rollout.devices - rollout.tp) // wide,
                      round(rollout.devices * share / wide)))
    short = (rollout.devices - long * wide) // rollout.tp
    expected_long = lengths.moment_above(1, short_tokens) / max(
        lengths.moment_above(0, short_tokens), 1e-9) + workload.prompt_tokens
    long_batch = max(1, min(rollout.max_batch_size,
                            int(default_kv_capacity(cost) // expected_long)))
    milestones = sorted({max(1, int(mean / 2)), int(mean), int(2 * mean)})
    return [f"rollout.num_workers={short + long}",
            f"routing.milestones=[{','.join(map(str, milestones))}]",
            "routing.rebuild_every=64",
            f"routing.buckets=[{{name: short, max_tokens: {short_tokens}, workers: {short}}}, "
            f"{{name: long, max_tokens: {longest}, workers: {long}, parallelism: {wide}"
            + (f", max_batch_size: {long_batch}}}]" if sized else "}]")]


def _long_work_share(lengths: ResponseLengths, threshold: int, cost: CostModel, batch: int,
                     prompt_tokens: int) -> float:
    """The share of decode time that responses longer than `threshold` take. Decode reads
    bytes: each token its share of the weights (weights / batch) and the KV cache of its whole
    context so far (prompt + position), so a response of L tokens reads
    (weights / batch + kv * prompt) * L + kv * L^2 / 2. Long responses take far more than their
    share of tokens: the attention reads grow with the square of the length."""
    kv = cost.model.kv_bytes_per_token(cost.dtype_bytes)
    linear, square = cost.weights_bytes / batch + kv * prompt_tokens, kv / 2

    def work(t: float) -> float:
        return linear * lengths.moment_above(1, t) + square * lengths.moment_above(2, t)
    return work(threshold) / work(1e-9)


def _colocated(config: EddyConfig) -> list[str]:
    """Both roles on all of the scenario's devices (rollout's and training's together), in
    turns: the trainer waits for the whole batch (a scenario's streamed trainer, verl's fully
    asynchronous one, is its split placement's)."""
    sim = config.sim
    if sim.rollout.accelerator != sim.train.accelerator:
        raise ConfigError(f"policy 'colocated' time-shares devices, but the scenario's rollout "
                          f"runs on {sim.rollout.accelerator} and training on "
                          f"{sim.train.accelerator}")
    devices = sim.rollout.devices + sim.train.devices
    return [f"sim.rollout.devices={devices}", f"sim.train.devices={devices}",
            "train.stream_chunks=1"]


# verl's fully asynchronous rollouter lets at most 16 samples (prompts) per rollout server
# generate at once (recipe/fully_async_policy/fully_async_rollouter.py, set_max_required_samples:
# max_concurrent_samples = len(server_handles) * 16, at most the samples started per sync)
VERL_PROMPTS_PER_SERVER = 16


def _ahead(config: EddyConfig, fraction: float) -> int:
    """Prompts in flight when the rollout runs `fraction` of a batch ahead of training."""
    return max(1, round(config.loop.batch_prompts * (1 + fraction)))


def _partial_window(config: EddyConfig) -> list[str]:
    """Partial rollout, `sim.staleness_threshold` of a batch ahead, as the system the scenario
    reproduces bounds it (`sim.reproduces`):

    - eddy: that many groups generating at once (`window.max_inflight_prompts`);
    - verl: that many groups started per weight sync, those still in flight at the sync
      counted (`window.max_started_per_sync`, verl's rollout_num), and 16 prompts generating
      per rollout server; and verl's loss: PPO clipped against the log-probs the rollout
      engine returned (use_rollout_log_probs, no recompute), so the trainer runs neither an
      old nor a proximal log-prob pass.

    Both take the scenario's K for the versions a trajectory may span (at least 1, to overlap
    at all); verl sets no such bound, so a verl scenario picks a K its runs never reach."""
    sim = config.sim
    ahead = _ahead(config, sim.staleness_threshold)
    k = f"window.max_staleness={max(1, config.window.max_staleness)}"
    if sim.reproduces == "verl":
        servers = sim.rollout.groups
        return [k, f"window.max_started_per_sync={ahead}",
                f"window.max_inflight_prompts={min(ahead, VERL_PROMPTS_PER_SERVER * servers)}",
                "sim.train.rollout_logprobs=true", "algorithm.decoupled=false"]
    return [k, f"window.max_inflight_prompts={ahead}"]


def _areal_window(config: EddyConfig) -> list[str]:
    """AReaL's asynchronous window, where the scenario reproduces AReaL: its K is
    max_head_offpolicyness (AReaL admits while (K + version + 1)·B > accepted + running, the
    version window's own deadline rule) and its groups generating at once are
    max_concurrent_rollouts. Elsewhere the registry's K = 3 stands."""
    if config.sim.reproduces != "areal":
        return []
    return [f"window.max_staleness={max(1, config.window.max_staleness)}",
            f"window.max_inflight_prompts={config.window.max_inflight_prompts}"]


# the implementations of the registry's scenario hooks (modes.SCENARIO_HOOKS), by name; each is
# a function of the scenario's config (with the command's overrides, before any mode's)
SCENARIO_HOOKS: dict[str, Callable[[EddyConfig], list[str]]] = {
    "colocated_devices": _colocated,
    "partial_window": _partial_window,
    "areal_window": _areal_window,
    "scenario_workers": lambda c: [f"rollout.num_workers={c.rollout.num_workers}"],
    "bucket_layout": _bucket,
    "bucket_layout_unsized": lambda c: _bucket(c, sized=False),
}

# the policies: every mode of the registry
POLICIES: dict[str, modes.Mode] = modes.MODES

# the synchronous baselines a speed-up is measured against (the faster one present)
SYNC_BASELINES = ("sync", "colocated")


def _mode(policy: str) -> modes.Mode:
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[policy]


def scenario_overrides(scenario: str | None, overrides: list[str], policy: str) -> list[str]:
    """What the policy's scenario hook adds on this scenario (none for most modes)."""
    mode = _mode(policy)
    if mode.scenario is None:
        return []
    return SCENARIO_HOOKS[mode.scenario](load_scenario(scenario, overrides))


def _current_names(overrides: list[str]) -> list[str]:
    """The command's overrides with a moved key's old name (`config.loader.RENAMED`) written as
    its new one, so that the mode's settings (new names) override it: the loader refuses an old
    and a new name in one list. It warns about the old name when it loads the scenario."""
    current = []
    for item in overrides:
        key, sep, value = item.partition("=")
        current.append(f"{RENAMED.get(key, key)}{sep}{value}")
    return current


def policy_config(scenario: str | None, overrides: list[str], policy: str) -> SimRunConfig:
    """The scenario with the command's overrides, the registry's BASE, the mode's own
    overrides and its scenario hook's, in that order."""
    mode = _mode(policy)
    base = load_scenario(scenario, overrides)  # the scenario as the command sets it
    extra = SCENARIO_HOOKS[mode.scenario](base) if mode.scenario else []
    return load_scenario(scenario, [*_current_names(overrides), *modes.BASE, *mode.overrides,
                                    *extra])


def compare(scenario: str | None, overrides: list[str], policies: list[str],
            on_done: Callable[[str, dict[str, Any]], None] = lambda p, r: None,
            out: str | None = None, plots: bool = True) -> dict[str, dict[str, Any]]:
    """Each policy simulated on the scenario, one after another; a row of numbers each. With
    `out` (a folder), each policy's workers' busy intervals go there as a Perfetto / Chrome
    trace (trace_<policy>.json) and, with `plots`, as a timeline plot (timeline_<policy>.png)."""
    from .runtime import simulate

    rows: dict[str, dict[str, Any]] = {}
    for policy in policies:
        trace = f"{out}/trace_{policy}.json" if out else None
        png = f"{out}/timeline_{policy}.png" if out and plots else None
        summary = simulate(policy_config(scenario, overrides, policy), trace_path=trace,
                           timeline_png=png)
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
    policy (needs matplotlib: the `observe` extra)."""
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

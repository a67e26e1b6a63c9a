"""`eddy plan --cluster SCENARIO`: the simulator searches split, mode, K, concurrency and
bucket layout for the scenario's model, lengths and cluster (cluster_search.py: the staged
search) and reports the best few with their predicted step time, trained samples/s, device
idle and memory fit (the memory plan of memory_plan.py on the scenario's devices).

A candidate's config is what `eddy bench sim --policies MODE` runs (sim/policies.py: the
scenario with the command's overrides, the registry's BASE, the mode, its scenario hook), with
the split among the command's overrides (so a hook sizes buckets and windows for it) and the
search's own settings last, over the mode's: K, groups in flight, rollout batch size, layout.
"""

from __future__ import annotations

import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import yaml

from ..errors import ConfigError, EddyError
from .cluster_search import Candidate, Outcome, SearchResult, Space, search

if TYPE_CHECKING:
    from ..sim.config import SimRunConfig

GIB = 2**30


def _current_names(overrides: list[str]) -> list[str]:
    """A moved key's old name written as its new one (config.loader.RENAMED), so that the
    mode's settings (new names) override it: the loader refuses both names in one list."""
    from ..config.loader import RENAMED

    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        out.append(f"{RENAMED.get(key, key)}{sep}{value}")
    return out


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()


def _relayout(hook: list[str], long_workers: int, rollout_devices: int, tp: int) -> list[str]:
    """The bucket hook's layout with `long_workers` instances in the long bucket and the rest
    of the rollout devices in short instances of tp `tp`."""
    from ..modes import settings

    buckets = settings(hook).get("routing.buckets")
    if not buckets:
        raise ConfigError("bucket layout: the mode lays out no routing.buckets")
    long = next(b for b in buckets if b["name"] == "long")
    wide = long.get("parallelism") or tp
    short_devices = rollout_devices - long_workers * wide
    if short_devices < tp or short_devices % tp:
        raise ConfigError(f"bucket layout: {long_workers} long instances of tp {wide} leave "
                          f"{short_devices} of {rollout_devices} rollout devices for short ones")
    for bucket in buckets:
        bucket["workers"] = long_workers if bucket is long else short_devices // tp
    workers = sum(b["workers"] for b in buckets)
    return [f"rollout.num_workers={workers}", f"routing.buckets={_flow(buckets)}"]


def candidate_config(scenario: str, overrides: list[str], candidate: Candidate,
                     steps: int) -> SimRunConfig:
    """The simulated run of `candidate` (module docstring)."""
    from ..modes import BASE, get
    from ..sim.config import load_scenario
    from ..sim.policies import scenario_overrides

    tp = load_scenario(scenario, overrides).sim.rollout.tp
    # the simulator sets rollout.num_workers from the instances (sim/runtime.py, build)
    first = _current_names([*overrides, f"loop.steps={steps}",
                            f"sim.rollout.devices={candidate.rollout_devices}",
                            f"sim.train.devices={candidate.train_devices}"])
    hook = scenario_overrides(scenario, first, candidate.mode)
    last = []
    if candidate.max_staleness is not None:
        last.append(f"window.max_staleness={candidate.max_staleness}")
    if candidate.inflight is not None:
        last.append(f"window.max_inflight_prompts={candidate.inflight}")
    if candidate.batch_size is not None:
        last.append(f"sim.rollout.max_batch_size={candidate.batch_size}")
    if candidate.long_workers is not None:
        last += _relayout(hook, candidate.long_workers, candidate.rollout_devices, tp)
    return load_scenario(scenario, [*first, *BASE, *get(candidate.mode).overrides, *hook,
                                    *last])


def ran_with(config: SimRunConfig) -> dict[str, Any]:
    """The settings a candidate ran with, for the search's next stage and the report."""
    long = [b.workers for b in config.routing.buckets if b.name == "long"] \
        if config.routing.policy != "none" else []
    return {"placement": config.cluster.placement, "max_staleness": config.window.max_staleness,
            "inflight": config.window.max_inflight_prompts,
            "batch_size": config.sim.rollout.max_batch_size,
            "long_workers": long[0] if long else None}


@contextmanager
def _short_runs() -> Iterator[None]:
    """The loader's warnings about short runs (a K larger than the steps can reach) speak of a
    real run of the same length; a plan's simulated runs are short on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@dataclass
class SimEvaluator:
    """Runs a candidate in the simulator: its row over the steady steps (`policies.row`)."""

    scenario: str
    overrides: list[str]
    steps: int
    progress: Callable[[Outcome], None] = lambda outcome: None

    def __call__(self, candidate: Candidate, stage: str) -> Outcome:
        from ..sim.policies import row
        from ..sim.runtime import simulate

        try:
            with _short_runs():
                config = candidate_config(self.scenario, self.overrides, candidate, self.steps)
                numbers = row(simulate(config))
        except EddyError as exc:  # a setting this candidate cannot have
            outcome = Outcome(candidate, stage, error=str(exc))
        except Exception as exc:  # noqa: BLE001 -- the simulator failed on this candidate:
            # the search goes on without it and says so (stderr, `evaluated` in --json)
            outcome = Outcome(candidate, stage,
                              error=f"the simulator failed: {type(exc).__name__}: {exc}")
        else:
            outcome = Outcome(candidate, stage, step_s=numbers["step_s"],
                              samples_per_s=numbers["samples_per_s"],
                              device_idle=numbers["device_idle"],
                              rollout_idle=numbers["rollout_idle"],
                              train_idle=numbers["train_idle"], settings=ran_with(config))
        self.progress(outcome)
        return outcome


# ---- memory fit --------------------------------------------------------------------------
def _shape_name(config: SimRunConfig) -> str | None:
    from ..models.config import shipped_shapes

    if config.model.shape is not None:
        return config.model.shape
    known = {name.lower(): name for name in shipped_shapes()}
    return known.get(config.sim.model.lower())


# The settings the simulator's cost model assumes and does not read from the run's config: vLLM
# in bf16 on 90 % of the device (sim/sequence.py default_kv_capacity), bf16 training (the
# cost model's dense BF16 peak). The run's built-in defaults are the tiny CPU run's (fp32, an
# exact KV cache), so where neither the scenario nor the command sets one the plan takes these.
# The trainer's checkpointing and micro-batches are not among them: the simulator times the
# scenario's own (sim/trainer.py), and the plan plans what it timed.
CLUSTER_MEMORY: tuple[tuple[str, Any], ...] = (
    ("rollout.engine", "vllm"), ("rollout.dtype", "bf16"), ("rollout.memory_fraction", 0.9),
    ("train.param_dtype", "bf16"))
# Shown beside them: the trainer's settings the step time was simulated with.
TRAINER_SETTINGS = ("train.activation_checkpointing", "train.micro_batch_size",
                    "train.max_tokens_per_micro_batch")


def _get(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def memory_fit(config: SimRunConfig) -> dict[str, Any]:
    """The memory plan of a candidate's run on the scenario's devices, or why there is none:
    the plan needs the model's shape (a shipped one by `sim.model`'s name, or `model.shape`).
    The roles split the model as the scenario's system does (`memory_plan.Parallelism`):
    rollout instances of their tensor-parallel width, the trainer's groups of `sim.train.tp`
    devices planned as Ulysses sequence parallelism under FSDP over `sim.train.fsdp_size` (all
    the trainer's devices when 0). The engine's context is the scenario's longest sequence even
    where the model's config.json has fewer positions (verl raises Qwen2.5-Math-7B's 4096 to
    32768 in its recipe's override_config)."""
    from collections import Counter

    from ..models.config import shape_file
    from ..sim.config import SimRunConfig
    from ..sim.runtime import instance_tps
    from .memory_plan import Parallelism, device_memory, plan_inputs, plan_memory, with_setting

    sim = config.sim
    shape = _shape_name(config)
    if shape is None:
        return {"planned": False, "reason": f"no shipped shape for sim.model {sim.model!r}; "
                "set model.shape to its config.json"}
    run, defaults = config, SimRunConfig()
    for key, value in CLUSTER_MEMORY:
        if _get(config, key) == _get(defaults, key):
            run = with_setting(run, key, value)
    for key, value in (("model.path", str(shape_file(shape).parent)),
                       ("rollout.max_new_tokens", sim.workload.max_response_tokens),
                       ("data.max_prompt_tokens", sim.workload.prompt_tokens),
                       ("rollout.max_batch_size", sim.rollout.max_batch_size),
                       ("rollout.num_workers", sim.rollout.groups),
                       ("train.num_workers", sim.train.devices)):
        run = with_setting(run, key, value)
    inputs = plan_inputs(run, sim.train.accelerator)
    longest = run.longest_sequence()
    positions = int(inputs.model_config.get("max_position_embeddings") or longest)
    parallel = Parallelism(rollout=tuple(sorted(Counter(instance_tps(config)).items())),
                           train_sp=sim.train.tp, train_shard=sim.train.fsdp_size)
    inputs = replace(inputs, memories={"train": inputs.memories["train"],
                                       "rollout": device_memory(None, sim.rollout.accelerator)},
                     model_config={**inputs.model_config,
                                   "max_position_embeddings": max(positions, longest)},
                     parallel=parallel)
    plan = plan_memory(run, inputs=inputs)
    return {"planned": True, "fits": plan.fits, "shape": shape,
            "context": {"longest": longest, "model_positions": positions},
            "parallel": {"rollout_tp": [tp for tp, _ in parallel.rollout],
                         "train_sequence_parallel": parallel.train_sp,
                         "train_fsdp_group": parallel.train_shard or sim.train.devices},
            "devices": [{"devices": d.label, "count": d.count, "peak_gib": d.peak / GIB,
                         "memory_gib": d.memory.bytes / GIB, "fits": d.fits,
                         **{k: r.details[k] for r in d.roles for k in ("concurrent_sequences",)
                            if k in r.details}}
                        for d in plan.devices],
            "settings": {key: _get(run, key)
                         for key in (*(k for k, _ in CLUSTER_MEMORY), *TRAINER_SETTINGS)},
            "fixes": [fix.override for fix in plan.fixes]}


CHECKPOINTING_ORDER = ("none", "selective", "full")  # least recompute first
MOST_SEQUENCES = 64  # the largest budget tried: 64 longest sequences a micro-batch


def scenario_fit_plans(scenario: str, overrides: list[str]) -> list[dict[str, Any]]:
    """The memory fit of the scenario's run at its own split and, where both roles run on one
    kind of device, colocated (every policy runs one of the two placements)."""
    from ..sim.config import load_scenario

    sim = load_scenario(scenario, overrides).sim
    modes = ("partial", "colocated") if sim.rollout.accelerator == sim.train.accelerator \
        else ("partial",)
    with _short_runs():
        return [memory_fit(candidate_config(scenario, overrides, Candidate(
            mode, sim.rollout.devices, sim.train.devices), 3)) for mode in modes]


def scenario_fits(scenario: str, overrides: list[str]) -> bool:
    """Whether the scenario's run fits its devices in both placements (`scenario_fit_plans`)."""
    return all(fit.get("fits", False) for fit in scenario_fit_plans(scenario, overrides))


def fitting_trainer(scenario: str, overrides: Sequence[str] = ()) -> tuple[str, int] | None:
    """The trainer settings a scenario takes when its source states none: the least recompute
    (`train.activation_checkpointing`: none, selective, full) with which some budget fits, then
    the largest `train.max_tokens_per_micro_batch` of a power of two of longest sequences (at
    most MOST_SEQUENCES) that fits, by the memory plan (`scenario_fits`); None when nothing
    does. A budget is a data-parallel group's, its tokens split over the group's devices."""
    from ..sim.config import load_scenario

    longest = load_scenario(scenario, list(overrides)).sim.workload.longest_sequence
    counts = [2 ** i for i in range(MOST_SEQUENCES.bit_length())][::-1]
    for kind in CHECKPOINTING_ORDER:
        for count in counts:
            setting = [f"train.activation_checkpointing={kind}",
                       f"train.max_tokens_per_micro_batch={count * longest}"]
            if scenario_fits(scenario, [*overrides, *setting]):
                return kind, count * longest
    return None


def memory_text(fit: dict[str, Any]) -> str:
    if not fit["planned"]:
        return "not planned"
    parts = ", ".join(f"{d['devices']} {d['peak_gib']:.0f}/{d['memory_gib']:.0f} GiB"
                      for d in fit["devices"])
    return ("fits: " if fit["fits"] else "DOES NOT FIT: ") + parts


# ---- the command -------------------------------------------------------------------------
def space_of(config: SimRunConfig, steps: int) -> Space:
    """The search space on the scenario. K is tried up to steps - 1: no trajectory of a run
    of `steps` steps can be older, so a larger K cannot show in it."""
    from ..sim.policies import POLICIES

    sim = config.sim
    return Space(modes=tuple(POLICIES), rollout_devices=sim.rollout.devices,
                 train_devices=sim.train.devices, rollout_tp=sim.rollout.tp,
                 train_tp=sim.train.tp, batch_prompts=config.loop.batch_prompts,
                 staleness_choices=tuple(k for k in (1, 2, 3, 4) if k <= max(1, steps - 1)))


def _progress(budget: int) -> Callable[[Outcome], None]:
    done = [0]

    def report(o: Outcome) -> None:
        done[0] += o.ok
        c, what = o.candidate, ""
        for name, value in (("K", c.max_staleness), ("inflight", c.inflight),
                            ("batch", c.batch_size), ("long", c.long_workers)):
            what += f" {name}={value}" if value is not None else ""
        result = (f"{o.step_s:.1f} s/step, {o.samples_per_s:.2f} samples/s" if o.ok
                  else f"refused: {o.error}")
        print(f"[{o.stage} {done[0]}/{budget}] {c.mode} {c.split}{what}: {result}",
              file=sys.stderr, flush=True)
    return report


def plan_cluster(scenario: str, overrides: list[str], budget: int, steps: int, top: int,
                 evaluate=None) -> dict[str, Any]:
    """The search on `scenario` and its report as a dict (`format_cluster_plan` prints it)."""
    from ..sim.config import load_scenario

    if top < 1:
        raise ConfigError(f"--top {top}: print at least 1 choice")
    if steps < 2:
        raise ConfigError(f"--steps {steps}: at least 2 (the first step fills the pipeline; "
                          "candidates are compared on the others)")
    config = load_scenario(scenario, overrides)
    space = space_of(config, steps)
    began = time.perf_counter()
    evaluate = evaluate or SimEvaluator(scenario, overrides, steps, _progress(budget))
    result: SearchResult = search(space, evaluate, budget)
    # The fastest that fit come first: a candidate planned not to fit its devices (fewer
    # training devices for the same model, say) is listed only after them, when fewer than
    # `top` fit; one whose memory is not planned keeps its place.
    choices, unfit = [], []
    for outcome in result.ranked():
        if len(choices) >= top:
            break
        entry = outcome.as_dict()
        try:
            with _short_runs():
                run = candidate_config(scenario, overrides, outcome.candidate, steps)
            entry["memory"] = memory_fit(run)
        except EddyError as exc:
            entry["memory"] = {"planned": False, "reason": str(exc)}
        fits = entry["memory"].get("fits", True)
        (choices if fits else unfit).append(entry)
    best = choices[0]["samples_per_s"] if choices else None
    faster_unfit = [e for e in unfit if best is not None and e["samples_per_s"] > best]
    choices += unfit[:top - len(choices)]
    return {"scenario": scenario, "overrides": overrides, "model": config.sim.model,
            "devices": {"rollout": f"{space.rollout_devices} {config.sim.rollout.accelerator}",
                        "train": f"{space.train_devices} {config.sim.train.accelerator}"},
            "default_split": f"{space.rollout_devices}:{space.train_devices}",
            "steps": steps, "budget": budget, "runs": result.runs,
            "wall_s": time.perf_counter() - began,
            "baseline": result.baseline.as_dict() if result.baseline else None,
            "choices": choices, "faster_not_fitting": len(faster_unfit),
            "evaluated": [o.as_dict() for o in result.outcomes]}


def _percent(value: float | None) -> str:
    # an idle share a rounding error below zero prints as 0 %, not "-0%"
    return "-" if value is None else f"{max(value, 0.0):.0%}"


def format_cluster_plan(plan: dict[str, Any]) -> str:
    lines = [f"eddy plan --cluster {plan['scenario']}: {plan['model']}, rollout "
             f"{plan['devices']['rollout']}, training {plan['devices']['train']}; "
             f"{plan['runs']} simulated runs of {plan['steps']} steps in {plan['wall_s']:.0f} s",
             "compared on the steady steps (all but the first, which fills the pipeline); "
             "faster: more trained samples/s"]
    base = plan["baseline"]
    if base is None:
        return "\n".join([*lines, "no registry mode ran on this scenario (see the errors)"])
    lines.append(f"best registry mode at the default split {plan['default_split']}: "
                 f"{base['mode']}, {base['step_s']:.1f} s/step, "
                 f"{base['samples_per_s']:.2f} samples/s")
    lines += ["", "| # | mode | split | K | in flight | batch | long | step s | samples/s | "
              "device idle | memory |", "|---" * 11 + "|"]
    notes = []
    for i, c in enumerate(plan["choices"], 1):
        s = c["settings"]
        split = c["split"] if s.get("placement") != "colocated" else \
            f"all {c['rollout_devices'] + c['train_devices']} shared"
        lines.append(f"| {i} | {c['mode']} | {split} | {s['max_staleness']} | "
                     f"{s['inflight'] or '-'} | {s['batch_size']} | {s['long_workers'] or '-'} "
                     f"| {c['step_s']:.1f} | {c['samples_per_s']:.2f} | "
                     f"{_percent(c['device_idle'])} | {memory_text(c['memory'])} |")
        if not c["memory"]["planned"] and c["memory"]["reason"] not in notes:
            notes.append(c["memory"]["reason"])
    lines += [f"memory not planned: {note}" for note in notes]
    if plan.get("faster_not_fitting"):
        lines.append(f"{plan['faster_not_fitting']} faster candidate(s) are planned not to fit "
                     "their devices and come after the ones that fit (--json: choices)")
    return "\n".join(lines)

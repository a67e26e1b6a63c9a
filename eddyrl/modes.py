"""The training modes, each defined once: a list of `key=value` overrides on one loop, with a
one-line description and when to use it. Everything that names a mode takes it from here:

- a real run: `eddyrl/configs/modes/<name>.yaml`, generated from this registry
  (`python -m eddyrl.modes --write`; `--check` says which file is out of date, and a test fails
  while one is);
- `bench/modes.py`: the same overrides over the defaults;
- the simulator (`eddy bench sim <scenario> --policies a,b`, `eddyrl/sim/policies.py`): the
  scenario, then `BASE`, then the same overrides, then the mode's named `scenario` hook.

A mode's `scenario` hook names what the simulator adds from the scenario it runs (its devices,
its workload, its batch, its K): settings that depend on the cluster, so no file can hold them.
Only the simulator applies a hook, after the mode's own overrides; `SCENARIO_HOOKS` says what
each one sets and `eddyrl/sim/policies.py` computes it. The hooks live there (this module does
not import the simulator, which imports it), so the registry stays data; overrides are read by
the config loader's own parser (`config.parse_overrides`).

`BASE` sets every dimension some mode sets, at the built-in default. The simulator applies it
first, so a scenario's own choices (libra_48 routes, reflow_8 replays) do not leak into a
comparison; a real run starts from the built-in defaults, which are the same values (a test
checks), so a mode file lists only the mode's own settings.

Where the real mode files and the simulator's policies used to disagree, each name now has the
simulator's definition (the one a comparison table measured), with the off-policy loss that a
real run needs once K > 0; the mode's description says what it is.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from .config.loader import parse_overrides
from .errors import ConfigError

# The folder of the generated mode files (package data, found by `load_config("modes/<name>")`)
FOLDER = Path(__file__).resolve().parent / "configs" / "modes"

# Every dimension a mode sets, at its built-in default (the simulator's reset of a scenario)
BASE: tuple[str, ...] = (
    "window.max_staleness=0", "window.max_inflight_prompts=0",
    "window.max_started_per_sync=0", "window.refill=batch",
    "window.partial_rollout=false", "window.migrate=true", "window.fill_legacy=false",
    "algorithm.decoupled=false", "algorithm.tis_cap=null", "algorithm.correction=none",
    "algorithm.max_refill_rounds=0",
    "replay.max_fraction=0", "routing.policy=none", "cluster.placement=split",
    "elastic.enabled=false", "adaptive.enabled=false", "adaptive.switch_partial_rollout=false",
)


@dataclass(frozen=True, slots=True)
class ScenarioHook:
    """What the simulator adds to a mode from the scenario: `keys` are all it may set."""

    doc: str
    keys: tuple[str, ...]


# The simulator-only additions, by name (implemented in eddyrl/sim/policies.py)
SCENARIO_HOOKS: dict[str, ScenarioHook] = {
    "colocated_devices": ScenarioHook(
        "both roles get all of the scenario's devices (its rollout and its training devices "
        "together), in turns, so a step trains its batch in one part; needs one accelerator "
        "for both",
        ("sim.rollout.devices", "sim.train.devices", "train.stream_chunks")),
    "partial_window": ScenarioHook(
        "K is the scenario's own (at least 1: how many versions a trajectory may span; verl "
        "sets no such bound) and the rollout runs sim.staleness_threshold (verl's, 0.5 unless "
        "the scenario says) of the scenario's loop.batch_prompts ahead, bounded as the system "
        "named by sim.reproduces bounds it (eddy: groups generating; verl: groups started per "
        "weight sync, and 16 generating per rollout server, with verl's loss: clipped against "
        "the rollout engine's log-probs, no old or proximal log-prob pass)",
        ("window.max_staleness", "window.max_inflight_prompts",
         "window.max_started_per_sync", "sim.train.rollout_logprobs", "algorithm.decoupled")),
    "areal_window": ScenarioHook(
        "on a scenario that reproduces AReaL (sim.reproduces: areal), the scenario's own K "
        "(AReaL's max_head_offpolicyness) and groups in flight (window.max_inflight_prompts, "
        "AReaL's max_concurrent_rollouts); on any other, nothing",
        ("window.max_staleness", "window.max_inflight_prompts")),
    "scenario_workers": ScenarioHook(
        "the scenario's own rollout workers (one per instance of its cluster)",
        ("rollout.num_workers",)),
    "bucket_layout": ScenarioHook(
        "Libra's buckets over the scenario's rollout devices: a short bucket for twice the mean "
        "response and a long one of instances twice as wide, devices in proportion to the "
        "decode work each gets, milestones at half, one and two mean responses, the long "
        "bucket's batch sized to its KV cache",
        ("rollout.num_workers", "routing.milestones", "routing.rebuild_every",
         "routing.buckets")),
    "bucket_layout_unsized": ScenarioHook(
        "bucket_layout without the long bucket's own batch size (the adaptive scheduler's "
        "plans set one batch size for every worker)",
        ("rollout.num_workers", "routing.milestones", "routing.rebuild_every",
         "routing.buckets")),
}


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    overrides: tuple[str, ...]  # the mode's own settings, `key=value`, each key once
    description: str  # one line: what the mode is
    when: str  # one line: when to use it
    scenario: str | None = None  # a SCENARIO_HOOKS name: what only the simulator adds
    note: str = ""  # anything else a user of the mode file should know

    def settings(self) -> dict[str, Any]:
        """The overrides as {dotted key: value}, values parsed as the config loader does."""
        return settings(self.overrides)

    def tree(self) -> dict[str, Any]:
        """The overrides as the nested mapping a YAML file holds."""
        return tree(self.overrides)


def settings(overrides: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings to {key: value}; values are YAML scalars or flow collections, as
    `eddyrl.config.parse_overrides` reads them; a later key wins."""
    found: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"mode override {item!r} is not of the form key=value")
        found[key] = yaml.safe_load(raw) if raw != "" else ""
    return found


def tree(overrides: Iterable[str]) -> dict[str, Any]:
    """The overrides as the nested mapping a YAML file holds, as the loader reads them."""
    return parse_overrides(list(overrides))


def _merged(*groups: Sequence[str]) -> tuple[str, ...]:
    """Override lists one after another, each key once (the last value, at its first place)."""
    values: dict[str, str] = {}
    for group in groups:
        for item in group:
            key = item.partition("=")[0]
            values[key] = item
    return tuple(values.values())


# --- the building blocks ------------------------------------------------------------------
# the off-policy loss every mode with lag needs: AReaL's decoupled objective, DORA's truncated
# importance sampling, token_tis at its default cap 2.0 (a run may pick another
# `algorithm.correction` on top; the simulator models no loss; a real run does)
_OFF_POLICY = ("algorithm.decoupled=true", "algorithm.correction=token_tis")
_STREAM = ("window.refill=stream",)
_K1 = ("window.max_staleness=1", *_OFF_POLICY)  # up to two batches in flight
_MULTIVERSION = ("window.max_staleness=3", *_OFF_POLICY, "window.migrate=true",
                 "window.fill_legacy=true", *_STREAM)
_REPLAY = ("replay.max_fraction=0.25", "replay.loss_weight=0.5", "replay.max_lag=2")
# Libra's router as a real run of the bundled tiny model has it: two rollout workers, a short
# bucket (wide batches) and a long one (narrow); the simulator lays buckets out per scenario
_ROUTER = ("rollout.num_workers=2", "routing.policy=bucket", "routing.milestones=[8, 16, 32]",
           "routing.min_observations=8", "routing.window=200", "routing.rebuild_every=16")
_BUCKETS = ("routing.buckets=[{name: short, max_tokens: 24, workers: 1, max_batch_size: 256}, "
            "{name: long, max_tokens: 54, workers: 1, max_batch_size: 32}]",)
_BUCKETS_UNSIZED = ("routing.buckets=[{name: short, max_tokens: 24, workers: 1}, "
                    "{name: long, max_tokens: 54, workers: 1}]",)
# the elastic pool needs a worker to lend: two rollout workers in a real run of the tiny model
_ELASTIC = ("rollout.num_workers=2", "elastic.enabled=true", "adaptive.enabled=true",
            "adaptive.window=2", "adaptive.cooldown_steps=2")

_MODES = [
    Mode("sync", ("window.max_staleness=0",),
         "K = 0: synchronous on-policy GRPO; each batch is generated on the current weights, "
         "then trained, rollout and training on their own devices.",
         "the baseline every speed-up is measured against; debugging"),
    Mode("colocated", ("window.max_staleness=0", "cluster.placement=colocated"),
         "K = 0 with every device time-shared by both roles (verl's hybrid engine): "
         "generation and training take turns on the same devices.",
         "one device, or a cluster too small to split; the other synchronous baseline",
         scenario="colocated_devices"),
    Mode("one_step", (*_K1, "window.max_inflight_prompts=${loop.batch_prompts}"),
         "K = 1 with one batch in flight (textbook one-step off-policy): the next batch "
         "generates on the previous weights while the trainer trains.",
         "rollout and training on their own devices, with the least staleness"),
    Mode("partial", (*_K1, "window.partial_rollout=true", *_STREAM),
         "K = 1 with partial rollout as verl's fully asynchronous trainer runs it: generation "
         "streams, and running trajectories take each new version at their next decode step "
         "(every token records its version); the simulator takes the scenario's K.",
         "long tails where waiting for the slowest trajectory dominates and mixed-version "
         "trajectories are acceptable",
         scenario="partial_window"),
    Mode("async", ("window.max_staleness=3", *_OFF_POLICY, "window.partial_rollout=true",
                   *_STREAM),
         "K = 3 with partial rollout and streaming refill (AReaL-style: interruptible "
         "generation, bounded staleness, prompts topped up as groups finish); the same window "
         "as multiversion, so the two differ only in how a trajectory meets a new version.",
         "the most overlap, when bounded staleness and mixed-version trajectories are "
         "acceptable",
         scenario="areal_window"),
    Mode("multiversion", _MULTIVERSION,
         "DORA's multi-version streaming rollout, K = 3: one policy version per trajectory, "
         "legacy requests moved off the workers the new version needs, free legacy slots "
         "filled, prompts topped up as groups finish.",
         "many rollout workers and long tails, keeping each trajectory on one version"),
    Mode("replay", (*_K1, *_REPLAY),
         "ReFlow's replay cycle with K = 1, as ReFlow runs it: a quarter of each batch is "
         "replayed groups (sigma 0.25) at loss weight tau 0.5, lag at most delta 2.",
         "generation is the cost and reusing recent informative groups is acceptable"),
    Mode("bucket", (*_K1, *_ROUTER, *_BUCKETS),
         "Libra's bucket router with K = 1: requests start in the short bucket and move to the "
         "long one when the length predicted at a milestone says so (all adds it to "
         "multiversion).",
         "response lengths vary widely and rollout workers have their own devices",
         scenario="bucket_layout",
         note="The layout is sized for the bundled tiny model. Set routing.policy to "
              "round_robin, least_load or fifo to compare with the baselines on the same run."),
    Mode("elastic", (*_K1, *_ELASTIC),
         "Libra's elastic pool with the adaptive scheduler, K = 1: rollout workers are lent to "
         "training when training is the bottleneck, and given back.",
         "the train / rollout balance shifts during the run, or training is the bottleneck",
         scenario="scenario_workers"),
    Mode("all", _merged(_MULTIVERSION, _REPLAY, ("replay.max_lag=4",), _ROUTER, _BUCKETS),
         "multiversion + replay + bucket: DORA's multi-version streaming rollout (K = 3) with "
         "ReFlow's replay (max_lag 4: a fresh group is already up to K versions old) and "
         "Libra's router.",
         "large clusters, once each part has been checked on its own",
         scenario="bucket_layout"),
    Mode("all_elastic", _merged(_MULTIVERSION, _REPLAY, ("replay.max_lag=4",), _ROUTER,
                                _BUCKETS_UNSIZED, _ELASTIC),
         "all + Libra's elastic pool and the adaptive scheduler; the buckets set no batch size "
         "of their own (the scheduler's plans set one for every worker).",
         "large clusters whose train / rollout balance shifts, once all runs well",
         scenario="bucket_layout_unsized"),
]

MODES: dict[str, Mode] = {mode.name: mode for mode in _MODES}


def get(name: str) -> Mode:
    if name not in MODES:
        from .validation import did_you_mean

        raise ConfigError(f"unknown mode {name!r}{did_you_mean(name, list(MODES))}; choose "
                          f"from {', '.join(MODES)}")
    return MODES[name]


# --- the mode files -----------------------------------------------------------------------

def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False,
                          width=10**6).removesuffix("\n...\n").strip()


def _lines(node: dict[str, Any], indent: int = 0) -> list[str]:
    pad = " " * indent
    lines = []
    for key, value in node.items():
        if isinstance(value, dict):
            lines += [f"{pad}{key}:", *_lines(value, indent + 2)]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += [f"{pad}{key}:", *(f"{pad}  - {_scalar(v)}" for v in value)]
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return lines


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, 97, initial_indent="# ", subsequent_indent="# ")


def render(mode: Mode) -> str:
    """The text of `eddyrl/configs/modes/<mode.name>.yaml`."""
    head = [*_comment(f"{mode.name}: {mode.description}"),
            *_comment(f"When to use it: {mode.when}.")]
    if mode.note:
        head += _comment(mode.note)
    if mode.scenario:
        head += _comment(f"In the simulator (eddy bench sim), the scenario adds "
                         f"({mode.scenario}): {SCENARIO_HOOKS[mode.scenario].doc}.")
    head += _comment("Generated from the mode registry (eddyrl/modes.py) by `python -m "
                     "eddyrl.modes --write`: edit the registry, not this file.")
    return "\n".join([*head, *_lines(mode.tree())]) + "\n"


def stale(folder: Path = FOLDER) -> list[str]:
    """The mode files that differ from the registry, are missing, or have no mode."""
    found = {p.stem for p in folder.glob("*.yaml")}
    wrong = [f"{name}.yaml" for name, mode in MODES.items()
             if name not in found or (folder / f"{name}.yaml").read_text() != render(mode)]
    return sorted(wrong + [f"{name}.yaml (no such mode)" for name in found - set(MODES)])


def write(folder: Path = FOLDER) -> list[str]:
    """Write every mode's file and remove files of modes that no longer exist."""
    folder.mkdir(parents=True, exist_ok=True)
    changed = stale(folder)
    for path in folder.glob("*.yaml"):
        if path.stem not in MODES:
            path.unlink()
    for name, mode in MODES.items():
        (folder / f"{name}.yaml").write_text(render(mode))
    return changed


def table() -> str:
    """name | what it sets | when to use it, as a Markdown table."""
    rows = ["| mode | what it sets | when to use it |", "|---|---|---|"]
    for mode in MODES.values():
        sets = ", ".join(f"`{item}`" for item in mode.overrides)
        if mode.scenario:
            sets += f"; the simulator adds `{mode.scenario}`"
        rows.append(f"| `{mode.name}` | {sets} | {mode.when} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eddyrl.modes",
                                     description="the mode registry and its mode files")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true",
                        help=f"write the mode files ({FOLDER}) from the registry")
    action.add_argument("--check", action="store_true",
                        help="exit 1 if a mode file differs from the registry")
    ns = parser.parse_args(argv)
    if ns.write:
        changed = write()
        print(f"wrote {len(MODES)} mode files into {FOLDER}"
              + (f"; changed: {', '.join(changed)}" if changed else "; none changed"))
        return 0
    if ns.check:
        wrong = stale()
        if wrong:
            print(f"out of date: {', '.join(wrong)}; run python -m eddyrl.modes --write",
                  file=sys.stderr)
            return 1
        print(f"the {len(MODES)} mode files match the registry")
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

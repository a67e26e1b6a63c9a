"""The simulator against every published row it has a scenario for, in one invocation.

    python bench/sim_fidelity.py [--rows PATTERN,...] [--steps 3] [--scale 0.5,1,2]
                                 [--json FILE] [--list]

For each row of each published table: the predicted step time (the steady steps of a simulated
run of the row's scenario and policy: every step but the first, as `eddy bench sim` reports
them), the published one, the error, and the speed-up over the table's baseline row, predicted
against published; per table, whether the modes rank in the published order. Prints how it was
run first (date, command, steps, machine) and the wall time last. `--rows` takes row ids or
shell patterns (`verl_7b_128/*`, `dora_64/partial`); `--list` prints the rows without running.

`--scale 0.5,1,2` runs every selected row on its cluster scaled by each factor (every device
count multiplied, kept a multiple of each role's tp: eddyrl/sim/scale.py; the batch and workload
unchanged) and prints the predicted step time per scale side by side, with each step's ratio
to the 1x one (to the first scale given, without 1): the check issue 35 makes of held-back
rows at 2x and 0.5x, that the model scales by physics. The fidelity table is printed for scale
1 only.

The runs are the simulator's own (`eddyrl.sim.policies.policy_config` and
`eddyrl.sim.runtime.simulate`, as `eddy bench sim` runs a policy); rows of one table that share
a run (the same scenario, policy and overrides) run it once. The 15 % target of issue 35 is
this bench's to report, not a test's: simulated step times change with the cost model.

Every row cites where its number comes from (`Row.source`); tests/fast/sim/test_fidelity_rows.py
checks that each does and that its scenario and policy exist.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import platform
import shlex
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

TARGET = 0.15  # issue 35: every published row within 15 % in step time

DORA = "DORA paper, arXiv 2604.26256 (dora_64 scenario's setting; bench/results/README.md)"
VERL_7B = ("volcengine/verl docs/advance/fully_async.md, 'Asynchronous Training on 7B Model' "
           "(step column)")
VERL_MODES = ("volcengine/verl docs/advance/fully_async.md, '128-card 7B Asynchronous Mode "
              "Experiment' and '128-card Stale Ablation Experiment' (step column)")
AREAL = ("inclusionAI/AReaL blog/AReaL_v0_3.md, Table 2 (training hours / 1000 PPO steps)")


@dataclass(frozen=True, slots=True)
class Row:
    """One published row: the scenario and policy that reproduce it, with the overrides that
    say its cluster size or setting, and the step time the source reports."""

    table: str  # rows of one table share a baseline and are ranked together
    label: str
    scenario: str  # a bundled scenario (eddyrl/configs/sim/<scenario>.yaml)
    policy: str  # a policy of eddyrl/sim/policies.py (a mode of the registry)
    published_step_s: float
    source: str
    overrides: tuple[str, ...] = ()
    baseline: bool = False  # the table's synchronous baseline: speed-ups are against it

    @property
    def id(self) -> str:
        return f"{self.table}/{self.label}"


def _verl_size(devices_per_role: int) -> tuple[str, ...]:
    return (f"sim.rollout.devices={devices_per_role}", f"sim.train.devices={devices_per_role}")


ROWS: tuple[Row, ...] = (
    # DORA's 64-GPU table (Qwen2.5-32B, 64 H800), minutes x 60
    Row("dora_64", "colocated", "dora_64", "colocated", 22.91 * 60, DORA, baseline=True),
    Row("dora_64", "one_step", "dora_64", "one_step", 22.94 * 60, DORA),
    Row("dora_64", "partial", "dora_64", "partial", 17.38 * 60, DORA),
    Row("dora_64", "dora", "dora_64", "multiversion", 14.67 * 60, DORA),
    # verl's 7B table: colocated sync on N GPUs vs fully async on N/2 : N/2
    Row("verl_7b_32", "colocated", "verl_7b_64", "colocated", 790.10, VERL_7B,
        _verl_size(16), baseline=True),
    Row("verl_7b_32", "fully_async", "verl_7b_64", "partial", 294.77, VERL_7B, _verl_size(16)),
    Row("verl_7b_64", "colocated", "verl_7b_64", "colocated", 365.28, VERL_7B, baseline=True),
    Row("verl_7b_64", "fully_async", "verl_7b_64", "partial", 189.26, VERL_7B),
    Row("verl_7b_128", "colocated", "verl_7b_64", "colocated", 356.30, VERL_7B,
        _verl_size(64), baseline=True),
    Row("verl_7b_128", "fully_async", "verl_7b_64", "partial", 150.63, VERL_7B, _verl_size(64)),
    # verl's 128-card modes (64:64): stream off-policy pipeline (staleness 0), then partial
    # rollout at staleness 0.1, 0.3, 0.5
    Row("verl_7b_128_modes", "colocated", "verl_7b_64", "colocated", 356.30, VERL_MODES,
        _verl_size(64), baseline=True),
    Row("verl_7b_128_modes", "stream_off_policy", "verl_7b_64", "partial", 231.34, VERL_MODES,
        (*_verl_size(64), "sim.staleness_threshold=0")),
    Row("verl_7b_128_modes", "staleness_0.1", "verl_7b_64", "partial", 171.30, VERL_MODES,
        (*_verl_size(64), "sim.staleness_threshold=0.1")),
    Row("verl_7b_128_modes", "staleness_0.3", "verl_7b_64", "partial", 146.11, VERL_MODES,
        (*_verl_size(64), "sim.staleness_threshold=0.3")),
    Row("verl_7b_128_modes", "staleness_0.5", "verl_7b_64", "partial", 150.63, VERL_MODES,
        _verl_size(64)),
    # AReaL's synchronous vs asynchronous table (R1-Distill-Qwen-1.5B, 16 nodes of 8 H800)
    Row("areal_1p5b_128", "sync", "areal_1p5b_128", "sync", 41.0 * 3600 / 1000, AREAL,
        ("sim.rollout.devices=64", "sim.train.devices=64"), baseline=True),
    Row("areal_1p5b_128", "async", "areal_1p5b_128", "async", 14.8 * 3600 / 1000, AREAL),
)


@dataclass(slots=True)
class Result:
    row: Row
    predicted_step_s: float
    wall_s: float
    run: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> float:
        return self.predicted_step_s / self.row.published_step_s - 1


def select(patterns: str | None) -> list[Row]:
    """The rows whose id matches one of the comma-separated patterns (all without)."""
    if not patterns:
        return list(ROWS)
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    rows = [r for r in ROWS if any(fnmatch.fnmatchcase(r.id, p) for p in wanted)]
    if not rows:
        raise SystemExit(f"--rows {patterns!r} matches no row; the rows are: "
                         + ", ".join(r.id for r in ROWS))
    return rows


def scale_overrides(row: Row, scale: float) -> list[str]:
    """The overrides that put the row's cluster (its scenario with its own overrides) on
    `scale` times the devices; none at 1."""
    if scale == 1:
        return []
    from eddyrl.sim.config import load_scenario
    from eddyrl.sim.scale import scale_overrides as scaled

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"window\.max_staleness = .* loop\.steps")
        return scaled(load_scenario(row.scenario, list(row.overrides)), scale)


def simulate_row(row: Row, steps: int, scale: float = 1.0
                 ) -> tuple[float, dict[str, Any], float]:
    """(steady step time, the run's numbers, wall seconds) of the row's scenario and policy,
    on `scale` times its cluster. The numbers add the split the run had (`split`: rollout :
    train devices, or the devices both roles share) and its steady steps' mean training phase
    (`train_s`: the trainer's step, log-prob passes included)."""
    from eddyrl.plan.cluster import memory_fit, memory_text
    from eddyrl.sim.policies import policy_config, row as summary_row
    from eddyrl.sim.runtime import simulate

    began = time.perf_counter()
    with warnings.catch_warnings():
        # a short run warns that K >= loop.steps bounds nothing more: true, and beside the point
        warnings.filterwarnings("ignore", message=r"window\.max_staleness = .* loop\.steps")
        config = policy_config(row.scenario, [*row.overrides, *scale_overrides(row, scale),
                                              f"loop.steps={steps}"], row.policy)
        summary = simulate(config)
    numbers = summary_row(summary)
    # whether the simulated cluster's trainer and engines fit their devices (the memory plan
    # of `eddy plan --cluster`): a prediction for a cluster that cannot run is flagged
    fit = memory_fit(config)
    numbers["fits"] = fit["fits"] if fit["planned"] else None
    numbers["memory"] = memory_text(fit)
    sim = config.sim
    numbers["split"] = (f"{sim.train.devices} shared" if config.cluster.placement == "colocated"
                        else f"{sim.rollout.devices}:{sim.train.devices}")
    steady = [m for m in summary["history"] if m.get("step", 0) > 0][1:]
    numbers["train_s"] = sum(m.get("train_step_s", 0.0) for m in steady) / max(len(steady), 1)
    return numbers["step_s"], numbers, time.perf_counter() - began


def run(rows: list[Row], steps: int, log=print, scale: float = 1.0) -> list[Result]:
    cache: dict[tuple, tuple[float, dict[str, Any], float]] = {}
    results = []
    at = "" if scale == 1 else f" at {scale:g}x"
    for row in rows:
        key = (row.scenario, row.policy, tuple(sorted(row.overrides)))
        fresh = key not in cache
        if fresh:
            cache[key] = simulate_row(row, steps, scale)
        step_s, numbers, wall_s = cache[key]
        results.append(Result(row, step_s, wall_s if fresh else 0.0, numbers))
        log(f"# {row.id}{at}: {'ran in %.0f s' % wall_s if fresh else 'same run as above'}")
    return results


def _speedups(results: list[Result]) -> dict[str, tuple[float | None, float | None]]:
    """Row id -> (predicted, published) speed-up over its table's baseline row (None without
    one among the results)."""
    baselines = {r.row.table: r for r in results if r.row.baseline}
    out = {}
    for result in results:
        base = baselines.get(result.row.table)
        out[result.row.id] = (None, None) if base is None else (
            base.predicted_step_s / result.predicted_step_s,
            base.row.published_step_s / result.row.published_step_s)
    return out


def rankings(results: list[Result]) -> dict[str, dict[str, Any]]:
    """Per table: the rows fastest first, published and predicted, and whether they agree."""
    tables: dict[str, list[Result]] = {}
    for result in results:
        tables.setdefault(result.row.table, []).append(result)
    out = {}
    for table, members in tables.items():
        published = [r.row.label for r in sorted(members, key=lambda r: r.row.published_step_s)]
        predicted = [r.row.label for r in sorted(members, key=lambda r: r.predicted_step_s)]
        out[table] = {"published": published, "predicted": predicted,
                      "matches": published == predicted}
    return out


def _fits(result: Result) -> str:
    """yes / NO (the memory plan of the simulated cluster), - where it is not planned."""
    fits = result.run.get("fits")
    return "-" if fits is None else ("yes" if fits else "NO")


def report(results: list[Result]) -> str:
    speedups = _speedups(results)
    lines = [f"| row | policy | predicted step s | published step s | error | within "
             f"{TARGET:.0%} | speed-up predicted | speed-up published | fits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        predicted, published = speedups[result.row.id]
        lines.append(
            f"| {result.row.id} | {result.row.policy} | {result.predicted_step_s:.1f} | "
            f"{result.row.published_step_s:.1f} | {result.error:+.1%} | "
            f"{'yes' if abs(result.error) <= TARGET else 'NO'} | "
            f"{'-' if predicted is None else f'{predicted:.2f}'} | "
            f"{'-' if published is None else f'{published:.2f}'} | "
            f"{_fits(result)} |")
    lines.append("")
    for table, ranking in rankings(results).items():
        lines.append(f"ranking {table}: {'matches' if ranking['matches'] else 'DIFFERS'} "
                     f"(published, fastest first: {', '.join(ranking['published'])}; "
                     f"predicted: {', '.join(ranking['predicted'])})")
    within = sum(abs(r.error) <= TARGET for r in results)
    lines.append(f"rows within {TARGET:.0%}: {within} of {len(results)}; tables ranked as "
                 f"published: {sum(t['matches'] for t in rankings(results).values())} of "
                 f"{len(rankings(results))}")
    return "\n".join(lines)


def parse_scales(text: str) -> list[float]:
    """`0.5,1,2` -> [0.5, 1.0, 2.0]: positive factors, each once."""
    try:
        scales = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--scale {text!r}: give factors separated by commas, e.g. "
                         "0.5,1,2") from None
    if not scales or any(not s > 0 for s in scales) or len(set(scales)) != len(scales):
        raise SystemExit(f"--scale {text!r}: each factor once, each > 0, e.g. 0.5,1,2")
    return scales


def scaling_report(by_scale: dict[float, list[Result]]) -> str:
    """Each row's predicted step (and training phase) at every scale, with its devices, and
    the ratio of each step to the reference scale's (1, or the first given)."""
    scales = list(by_scale)
    reference = 1.0 if 1.0 in by_scale else scales[0]
    others = [s for s in scales if s != reference]
    lines = ["| row | policy | " + " | ".join(f"{s:g}x: devices, step s (train s)"
                                               for s in scales)
             + "".join(f" | step {s:g}x / {reference:g}x" for s in others) + " |",
             "|---|---|" + "---|" * (len(scales) + len(others))]
    unfit = False
    for index, base in enumerate(by_scale[reference]):
        cells = []
        for result in (by_scale[s][index] for s in scales):
            cells.append(f"{result.run['split']}, {result.predicted_step_s:.1f} "
                         f"({result.run['train_s']:.1f})"
                         + (" ✗" if result.run.get("fits") is False else ""))
            unfit |= result.run.get("fits") is False
        ratios = [f"{by_scale[s][index].predicted_step_s / base.predicted_step_s:.2f}"
                  for s in others]
        lines.append(f"| {base.row.id} | {base.row.policy} | " + " | ".join(cells)
                     + "".join(f" | {r}" for r in ratios) + " |")
    if unfit:
        lines.append("\n✗: the memory plan says this cluster's trainer or rollout engines do "
                     "not fit their devices at the scenario's settings; the time is of a run "
                     "that could not start")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", help="row ids or patterns, comma-separated (default: all)")
    parser.add_argument("--steps", type=int, default=3,
                        help="simulated steps a run (the first fills the pipeline and is not "
                             "counted); default 3")
    parser.add_argument("--scale", default="1", metavar="F,F,...",
                        help="run every row on its cluster times each factor (e.g. 0.5,1,2) "
                             "and print the step times side by side; default 1")
    parser.add_argument("--json", metavar="FILE", help="write the results here as JSON")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: needs at least 2 (the first is not counted)")
    rows = select(args.rows)
    scales = parse_scales(args.scale)
    if args.list:
        for row in rows:
            print(f"{row.id}: {row.scenario} / {row.policy} {' '.join(row.overrides)} "
                  f"-> {row.published_step_s:.1f} s ({row.source})")
        return 0
    began = time.perf_counter()
    command = shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"# bench/sim_fidelity.py, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"command: {command}")
    print(f"# loop.steps={args.steps} per run (steady steps: all but the first); "
          f"{len(rows)} rows; scales {', '.join(f'{s:g}' for s in scales)}; "
          f"{platform.node()}, python {platform.python_version()}")
    by_scale = {scale: run(rows, args.steps, scale=scale) for scale in scales}
    results = by_scale.get(1.0)
    if results is not None:
        print(report(results))
    if len(scales) > 1:
        print(scaling_report(by_scale))
    wall = time.perf_counter() - began
    print(f"# wall time {wall:.0f} s")
    if args.json:
        payload = {
            "date_utc": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M}", "command": command,
            "steps": args.steps, "wall_s": wall, "target": TARGET}
        if results is not None:
            speedups = _speedups(results)
            payload["rows"] = [
                {**asdict(r.row), "id": r.row.id, "predicted_step_s": r.predicted_step_s,
                 "error": r.error, "speedup_predicted": speedups[r.row.id][0],
                 "speedup_published": speedups[r.row.id][1], "run_wall_s": r.wall_s,
                 "run": r.run} for r in results]
            payload["rankings"] = rankings(results)
        if len(scales) > 1:
            payload["scales"] = {f"{scale:g}": [
                {"id": r.row.id, "predicted_step_s": r.predicted_step_s, "run": r.run}
                for r in found] for scale, found in by_scale.items()}
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Goodput under device failures at scale, a lost trainer device recovered in place (issue 37)
against a restart from the last checkpoint (Eddy today), in one invocation.

    python bench/goodput.py [--scenarios scale_1024,dora_64] [--every 10,50] [--days 7]
                            [--seeds 200] [--steps 9] [--rate R] [--json FILE]

Each scenario runs once on the simulator (`eddyrl.sim.runtime.simulate`, the real controller:
what `eddy sim <scenario> loop.steps=N` runs) for its steady step time, its training phase and
the pipeline's fill time; then `eddyrl.sim.failures` draws device failures over `--days` of
virtual time (`--seeds` seeded runs, the same failures for both recoveries) and reports, per
checkpoint interval: the failures a day per role, what one trainer failure costs under each
recovery (its expectation), and goodput (useful steps' time / wall time) under each, the
Monte Carlo's mean over seeds beside its analytic expectation. Prints how it was run, the
source of the failure rate and every assumed time first, the wall time last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone

from eddyrl.sim import failures
from eddyrl.sim.config import load_scenario
from eddyrl.sim.failures import (ClusterTiming, FailureSettings, RecoveryCosts,
                                 failures_per_day, in_place_goodput, loss_per_train_failure,
                                 restart_goodput)
from eddyrl.sim.runtime import simulate

RATE_SOURCE = (
    "Meta, 'The Llama 3 Herd of Models' (arXiv 2407.21783, 2024), section 3.3.4: 419 "
    "unexpected interruptions in a 54-day snapshot on 16,384 H100 -> 419 / (16,384 x 54 x 24 "
    "device-hours) = {rate:.3g} per device-hour")
STORAGE_SOURCE = ("the same paper, section 3.3.1: Tectonic sustains 2 TB/s for 16,384 GPUs -> "
                  "{share:.0f} MB/s per device of the job")


def timing_of(scenario: str, steps: int) -> tuple[ClusterTiming, list[float], float]:
    """The scenario's timing from one simulated run; each step's time; the run's wall
    seconds."""
    began = time.perf_counter()
    with warnings.catch_warnings():  # short runs warn that K >= loop.steps bounds nothing
        warnings.simplefilter("ignore")
        config = load_scenario(scenario, [f"loop.steps={steps}"])
        summary = simulate(config)
    step_times = [m["step_s"] for m in summary["history"] if m.get("step", 0) > 0]
    return ClusterTiming.of(config, summary), step_times, time.perf_counter() - began


def monte_carlo(timing: ClusterTiming, settings: FailureSettings, recovery: str,
                seeds: int) -> tuple[float, float]:
    """Goodput's mean over seeds 0..seeds-1 and the standard error of that mean."""
    values = [failures.run(timing, dataclasses.replace(settings, seed=seed), recovery).goodput
              for seed in range(seeds)]
    error = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return statistics.fmean(values), error


def rows(scenario: str, timing: ClusterTiming, base: FailureSettings, intervals: list[int],
         seeds: int) -> list[dict]:
    out = []
    for every in intervals:
        settings = dataclasses.replace(base, checkpoint_every=every)
        costs = RecoveryCosts.of(timing, settings)
        row = {"scenario": scenario, "every": every, "timing": dataclasses.asdict(timing),
               "costs": dataclasses.asdict(costs),
               "failures_per_day": failures_per_day(timing, settings),
               "loss_per_train_failure_s": loss_per_train_failure(timing, settings),
               "analytic": {"in_place": in_place_goodput(timing, settings),
                            "restart": restart_goodput(timing, settings)}}
        hidden = dataclasses.replace(settings, buddy_exposed=0.0)
        row["analytic"]["in_place_copy_hidden"] = in_place_goodput(timing, hidden)
        row["monte_carlo"] = {recovery: monte_carlo(timing, settings, recovery, seeds)
                              for recovery in ("in_place", "restart")}
        row["monte_carlo"]["in_place_copy_hidden"] = monte_carlo(timing, hidden, "in_place",
                                                                 seeds)
        out.append(row)
    return out


def table(found: list[dict]) -> str:
    lines = [
        "| scenario | devices (train + rollout) | steady step s | ckpt every | save s | "
        "failures / day (train + rollout) | s lost per trainer failure, in place / restart | "
        "goodput in place (MC ± se; analytic) | in place, buddy copy hidden | "
        "goodput restart (MC ± se; analytic) |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for row in found:
        t, day = row["timing"], row["failures_per_day"]
        loss, mc, an = row["loss_per_train_failure_s"], row["monte_carlo"], row["analytic"]
        lines.append(
            f"| {row['scenario']} | {t['train_devices']} + {t['rollout_devices']} | "
            f"{t['step_s']:.0f} | {row['every']} | {row['costs']['checkpoint_save_s']:.0f} | "
            f"{day['train']:.2f} + {day['rollout']:.2f} | "
            f"{loss['in_place']:.0f} / {loss['restart']:.0f} | "
            f"{mc['in_place'][0]:.4f} ± {mc['in_place'][1]:.4f}; {an['in_place']:.4f} | "
            f"{mc['in_place_copy_hidden'][0]:.4f}; {an['in_place_copy_hidden']:.4f} | "
            f"{mc['restart'][0]:.4f} ± {mc['restart'][1]:.4f}; {an['restart']:.4f} |")
    return "\n".join(lines)


def costs_table(found: list[dict]) -> str:
    lines = ["| scenario | train phase s | pipeline refill s | restart down s | "
             "in-place down s | buddy copy s / step | rollout failure charge s |",
             "|---|---|---|---|---|---|---|"]
    seen = set()
    for row in found:
        if row["scenario"] in seen:
            continue
        seen.add(row["scenario"])
        t, c = row["timing"], row["costs"]
        lines.append(f"| {row['scenario']} | {t['train_s']:.0f} | {t['refill_s']:.0f} | "
                     f"{c['restart_down_s']:.0f} | {c['in_place_down_s']:.0f} | "
                     f"{c['buddy_copy_s']:.2f} | {c['rollout_lost_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="scale_1024,dora_64")
    parser.add_argument("--every", default="10,50", help="checkpoint intervals in steps")
    parser.add_argument("--days", type=float, default=7.0, help="virtual days a run")
    parser.add_argument("--seeds", type=int, default=200, help="Monte Carlo runs per cell")
    parser.add_argument("--steps", type=int, default=9,
                        help="simulated steps per scenario (the first fills the pipeline; "
                             "scale_1024 alternates long and short steps, so 9 gives 4 pairs)")
    parser.add_argument("--rate", type=float, default=None,
                        help="failures per device-hour (default: Llama 3's)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: needs at least 2 (the first is not counted)")
    if args.seeds < 2:
        parser.error(f"--seeds {args.seeds}: needs at least 2 (for the standard error)")
    intervals = [int(v) for v in args.every.split(",")]
    base = FailureSettings(horizon_days=args.days)
    if args.rate is not None:
        base.rate_per_device_hour = args.rate
    for every in intervals:
        dataclasses.replace(base, checkpoint_every=every).validate()
    began = time.perf_counter()
    command = shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"# bench/goodput.py, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"command: {command}")
    print(f"# {platform.node()}, python {platform.python_version()}; loop.steps={args.steps} "
          f"per scenario; {args.seeds} seeds x {args.days:g} virtual days per cell")
    rate = base.rate_per_device_hour
    print("# failure rate: " + (RATE_SOURCE.format(rate=rate) if args.rate is None
                                else f"{rate:.3g} per device-hour (--rate)"))
    print("# storage: " + STORAGE_SOURCE.format(share=base.storage_bps_per_device / 1e6)
          + f"; checkpoint = {failures.CHECKPOINT_BYTES_PER_PARAM} bytes / parameter")
    print(f"# assumptions: detect {base.detect_s:g} s (both recoveries); in place: reform "
          f"{base.reform_s:g} s + the rank's shard over its host link; restart: relaunch "
          f"{base.relaunch_s:g} s + the checkpoint and every engine's weights read at the job's "
          f"storage bandwidth + the pipeline refill (simulated: first step - steady step, at "
          f"least 0); a lost rollout engine: start {base.engine_start_s:g} s + its weights "
          f"read, plus half a step's work, as its share of the rollout; buddy copy charged "
          f"{base.buddy_exposed:g} of the rank's shard over its host link per step")
    found = []
    for scenario in args.scenarios.split(","):
        timing, step_times, wall = timing_of(scenario, args.steps)
        print(f"# {scenario}: simulated {args.steps} steps in {wall:.0f} s wall; step times "
              + ", ".join(f"{t:.0f}" for t in step_times) + " s")
        found += rows(scenario, timing, base, intervals, args.seeds)
    print(table(found))
    print()
    print(costs_table(found))
    wall = time.perf_counter() - began
    print(f"# wall time {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"date_utc": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M}",
                       "command": command, "settings": dataclasses.asdict(base),
                       "wall_s": wall, "rows": found}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

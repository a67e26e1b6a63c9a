"""Training modes side by side: the tiny default on this machine, each mode from the same warm
start, seed and wall-clock budget, one after another in one invocation.

    python bench/modes.py [--config cipher_tiny] [--seconds 150]
                          [--modes sync,one_step,async,multiversion,replay,all]
                          [--variant 'NAME=MODE key=value ...'] [--target 0.6]
                          [--out bench/results] [key=value ...]

The modes are the mode registry's (eddyrl/modes.py: `python -m eddyrl.modes` lists them), each
with exactly the registry's settings, the same as its mode file and as `eddy bench sim`'s policy.

Prints how it was run and a table (training samples/s, generated tokens/s, trainer and rollout
idle fractions, staleness, replay fraction, held-out accuracy at fixed times, time to the target
accuracy, final accuracy), and writes results.json and accuracy_vs_time.png into --out.
`--config` is the run every mode starts from (a bundled config's name or a YAML file; the
built-in defaults when not given), then the mode's registry keys, then the key=value overrides,
which apply to every mode. Not part of the test suite: minutes per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the registry's modes this benchmark runs unless told otherwise (`--modes` takes any of them)
MODES = ("sync", "one_step", "async", "multiversion", "replay", "all")


def mode_config(mode: str, overrides: list[str], base: str | None = None):
    """The run of `mode`: `base` (a config's name or file; the built-in defaults when None), the
    registry's overrides for the mode, then `overrides` (the benchmark's own and the command
    line's)."""
    from eddyrl.config import load_config
    from eddyrl.modes import get

    return load_config(base, [*get(mode).overrides, *overrides])


def summarize(metrics: list[dict], summary: dict, target: float, marks: list[float]) -> dict:
    steps = [m for m in metrics if m["step"] > 0]
    evals = [(m["wall_s"], m["eval_accuracy"]) for m in metrics if "eval_accuracy" in m]
    start = metrics[0]["wall_s"]  # after start-up and the initial evaluation
    train_wall = max(steps[-1]["wall_s"] - start, 1e-9) if steps else 1e-9
    waited = sum(m.get("rollout_s", 0.0) for m in steps)
    at = {}
    for mark in marks:
        seen = [acc for wall, acc in evals if wall - start <= mark]
        at[f"acc@{mark:.0f}s"] = seen[-1] if seen else None
    reached = [wall - start for wall, acc in evals if acc >= target]
    return {
        "runtime": summary.get("runtime"),  # local (one process) or ray: cluster.runtime auto
        "steps": len(steps),
        "samples_per_s": sum(m.get("samples_trained", 0) for m in steps) / train_wall,
        "gen_tokens_per_s": sum(m.get("gen_tokens", 0) for m in steps) / train_wall,
        "trainer_idle_fraction": waited / train_wall,
        # share of the run (evaluations included) the rollout engines spent not decoding
        "rollout_idle_fraction": 1 - summary["rollout_busy_s"] / max(
            summary["seconds"] * summary["rollout_workers"], 1e-9),
        "staleness_mean": _mean([m.get("staleness_mean", 0.0) for m in steps]),
        "staleness_max": max((m.get("staleness_max", 0) for m in steps), default=0),
        "replay_fraction": _mean([m.get("replay_fraction", 0.0) for m in steps]),
        "initial_accuracy": summary["initial_eval_accuracy"],
        "final_accuracy": summary["final_eval_accuracy"],
        "time_to_target_s": reached[0] if reached else None,
        **at,
        "curve": [(wall - start, acc) for wall, acc in evals],
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    colors = plt.get_cmap("tab20").colors  # twenty, so a dozen modes do not share a colour
    for i, (mode, r) in enumerate(results.items()):
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="os^vD"[i % 5], markersize=3, linewidth=1.2,
                color=colors[(2 * i) % 20 + (2 * i) // 20], label=mode)
    ax.set_xlabel("training wall time (s, after start-up)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None,
                        help="the run every mode starts from, e.g. cipher_tiny (default: the "
                             "built-in defaults, the tiny arithmetic task)")
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--variant", action="append", default=[], metavar="'NAME=MODE K=V ...'",
                        help="an extra run: a registry mode with its own overrides, e.g. "
                             "'naive_replay=replay replay.max_fraction=0.75 "
                             "replay.loss_weight=1.0 replay.max_lag=1000000'")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from eddyrl.errors import ConfigError
    from eddyrl.launch import train
    from eddyrl.modes import get

    runs = {mode: (mode, []) for mode in args.modes.split(",")}  # name -> (mode, overrides)
    for variant in args.variant:
        head, *extra = shlex.split(variant)
        name, _, mode = head.partition("=")
        if not mode or name in runs:
            parser.error(f"--variant {variant!r}: want 'NAME=MODE K=V ...' with a new NAME")
        runs[name] = (mode, extra)
    for mode, _ in runs.values():
        try:
            get(mode)
        except ConfigError as exc:  # an unknown name, with the registry's names
            parser.error(str(exc))
    modes = list(runs)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [f"loop.max_seconds={args.seconds}", "loop.steps=100000",
              f"loop.eval_every={args.eval_every}", *args.overrides]
    print(f"# bench/modes.py on {platform.node()} ({os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}), python {sys.version.split()[0]}")
    print(f"# runs {[f'{n}={m}' + ''.join(' ' + o for o in x) for n, (m, x) in runs.items()]}; "
          f"from config {args.config or 'the built-in defaults'}; "
          f"budget {args.seconds:.0f} s of training each; target accuracy {args.target}; "
          f"overrides {common}")
    marks = [args.seconds / 4, args.seconds / 2, args.seconds]
    results = {}
    for mode in modes:
        run_dir = out / mode
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: eddy train refuses to append
        config = mode_config(runs[mode][0], [*common, *runs[mode][1], f"run_dir={run_dir}"],
                             args.config)
        began = time.monotonic()
        summary = json.loads(train(config).read_text())
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        results[mode] = summarize(metrics, summary, args.target, marks)
        print(f"# {mode}: done in {time.monotonic() - began:.0f} s", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    columns = ["runtime", "steps", "samples_per_s", "gen_tokens_per_s", "trainer_idle_fraction",
               "rollout_idle_fraction", "staleness_mean", "staleness_max", "replay_fraction",
               *[f"acc@{m:.0f}s" for m in marks], "time_to_target_s", "initial_accuracy",
               "final_accuracy"]
    print("| mode | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for mode, r in results.items():
        cells = [_fmt(r[c]) for c in columns]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    try:
        plot(results, out / "accuracy_vs_time.png")
        print(f"# wrote {out / 'results.json'} and {out / 'accuracy_vs_time.png'}")
    except ImportError:
        print(f"# wrote {out / 'results.json'} (pip install matplotlib for the PNG)")
    return 0


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())

"""Stability under an injected train-inference mismatch, side by side (issue 36).

    python bench/stability.py [--configs cipher_tiny,moe_tiny] [--seconds 150] [--k 4]
                              [--out bench/results/stability] [key=value ...]

Every run samples with the rollout engine in bf16 against an fp32 trainer (`rollout.dtype=bf16`:
the mismatch), from the same warm start, seed and wall-clock budget, one after another:

- `sync`: K = 0, the reference every other run is judged against;
- `k<K>`: DORA's multi-version rollout at a fixed K with the registry's off-policy loss
  (decoupled PPO, token-level truncated IS at 2);
- `k<K>_icepop`: the same with IcePop's two-sided token mask instead of truncation;
- `k<K>_replay` (mixture-of-experts configs only): the same with rollout routing replay;
- `governor`: the same as `k<K>` with the stability governor choosing K in [0, K].

Prints how it was run and one table per config (final and best held-out accuracy, steps/s,
training samples/s, mean train-rollout mismatch KL, masked fraction, the governor's K over the
steps), checks the issue's target (the governor's final accuracy within 2 points of sync's and
no worse than the best fixed setting's) and says plainly when it is not met. Writes
results.json and accuracy_vs_time_<config>.png into --out. Not part of the test suite: minutes
per run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from modes import ROOT, mode_config, plot, summarize  # noqa: E402  (bench/modes.py)

MISMATCH = ("rollout.dtype=bf16",)  # trainer stays at its fp32 default
TARGET_POINTS = 0.02  # the governor within 2 accuracy points of sync


def runs_for(config: str, k: int, moe: bool) -> dict[str, tuple[str, list[str]]]:
    """name -> (registry mode, overrides) for one config."""
    fixed = [f"window.max_staleness={k}"]
    runs = {
        "sync": ("sync", []),
        f"k{k}": ("multiversion", fixed),
        f"k{k}_icepop": ("multiversion", [*fixed, "algorithm.correction=icepop"]),
    }
    if moe:
        runs[f"k{k}_replay"] = ("multiversion", [*fixed, "rollout.routing_replay=true"])
    runs["governor"] = ("multiversion", [*fixed, "window.governor=true",
                                         "window.governor_min_staleness=0"])
    return runs


def signals(metrics: list[dict]) -> dict:
    """Means of the mismatch signals over the training steps, and the governor's K per step."""
    steps = [m for m in metrics if m.get("step", 0) > 0]

    def mean(key: str) -> float | None:
        values = [m[key] for m in steps if isinstance(m.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    return {"mismatch_kl": mean("mismatch_kl"), "mismatch_max_abs": mean("mismatch_max_abs"),
            "masked_fraction": mean("correction_masked_fraction"), "is_ess": mean("is_ess"),
            "governor_k": [m["governor_k"] for m in steps if "governor_k" in m]}


def verdict(results: dict[str, dict], k: int) -> str:
    if "governor" not in results or "sync" not in results:
        return "target: not judged (no governor or no sync run)"
    gov = results["governor"]["final_accuracy"]
    sync = results["sync"]["final_accuracy"]
    fixed = {n: r["final_accuracy"] for n, r in results.items()
             if n.startswith(f"k{k}")}
    best_name, best = max(fixed.items(), key=lambda item: item[1])
    near_sync = gov >= sync - TARGET_POINTS
    beats_fixed = gov >= best
    status = "MET" if near_sync and beats_fixed else "NOT MET"
    return (f"target {status}: governor {gov:.3f} vs sync {sync:.3f} (within "
            f"{TARGET_POINTS:.2f}: {'yes' if near_sync else 'no'}), best fixed {best_name} "
            f"{best:.3f} ({'not worse' if beats_fixed else 'worse'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="cipher_tiny,moe_tiny",
                        help="bundled configs (or YAML files) to run, comma-separated; a "
                             "name containing 'moe' also gets the routing-replay run")
    parser.add_argument("--seconds", type=float, default=150.0,
                        help="training wall-clock budget of each run")
    parser.add_argument("--k", type=int, default=4, help="the fixed staleness bound K")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "stability"))
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args()

    from eddyrl.launch import train

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [*MISMATCH, f"loop.max_seconds={args.seconds}", "loop.steps=100000",
              f"loop.eval_every={args.eval_every}", *args.overrides]
    print(f"# bench/stability.py on {platform.node()} ({os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}), python {sys.version.split()[0]}")
    print(f"# configs {args.configs}; K = {args.k}; budget {args.seconds:.0f} s of training "
          f"each; overrides on every run {common}")
    marks = [args.seconds / 4, args.seconds / 2, args.seconds]
    everything: dict[str, dict] = {}
    for config in args.configs.split(","):
        results: dict[str, dict] = {}
        for name, (mode, extra) in runs_for(config, args.k, "moe" in config).items():
            run_dir = out / config / name
            shutil.rmtree(run_dir, ignore_errors=True)  # eddy train refuses to append
            began = time.monotonic()
            cfg = mode_config(mode, [*common, *extra, f"run_dir={run_dir}"], config)
            summary = json.loads(train(cfg).read_text())
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            row = summarize(metrics, summary, 1.0, marks)
            row.update(signals(metrics))
            stepped = [m["wall_s"] for m in metrics if m.get("step", 0) > 0]
            row["steps_per_s"] = (len(stepped) / max(stepped[-1] - metrics[0]["wall_s"], 1e-9)
                                  if stepped else 0.0)
            row["best_accuracy"] = max((acc for _, acc in row["curve"]), default=None)
            results[name] = row
            print(f"# {config}/{name}: {mode} {' '.join(extra)}: done in "
                  f"{time.monotonic() - began:.0f} s", flush=True)
        everything[config] = results
        columns = ["steps", "steps_per_s", "samples_per_s", "staleness_mean", "mismatch_kl",
                   "mismatch_max_abs", "masked_fraction", "is_ess", "initial_accuracy",
                   "best_accuracy", "final_accuracy"]
        print(f"\n## {config}\n")
        print("| run | " + " | ".join(columns) + " | governor K by step |")
        print("|---" * (len(columns) + 2) + "|")
        for name, r in results.items():
            ks = "".join(str(k) for k in r["governor_k"]) or "-"
            print(f"| {name} | " + " | ".join(_fmt(r[c]) for c in columns) + f" | {ks} |")
        print(f"\n{verdict(results, args.k)}")
        try:
            plot(results, out / f"accuracy_vs_time_{Path(config).stem}.png")
        except ImportError:
            print("# (pip install matplotlib for the accuracy-vs-time PNG)")
    (out / "results.json").write_text(json.dumps(everything, indent=2))
    print(f"# wrote {out / 'results.json'}")
    return 0


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())

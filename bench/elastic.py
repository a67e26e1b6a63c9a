"""The elastic pool's step timeline: one run in which a rollout worker is lent to training and
given back while training goes on, with the time each step spent in the pool's driver.

    python bench/elastic.py [--steps 16] [--join 3] [--leave 10] [--out bench/results]
                            [key=value ...]

Prints how it was run and a per-step table (the lent worker's protocol state, replicas whose
gradients counted, step / rollout / train seconds, the driver's seconds on the critical path),
then the bound: the largest driver time and how the steps while the worker moved compare with
the others. Writes elastic_timeline.json and elastic_timeline.png (step time, with the worker's
state as bands).
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--join", type=int, default=3)
    parser.add_argument("--leave", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from eddyrl.config import load_config
    from eddyrl.launch import train

    out = Path(args.out).resolve()
    run_dir = out / "elastic_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"loop.steps={args.steps}", "loop.eval_every=0", "rollout.num_workers=2",
                 "window.max_staleness=1", "elastic.enabled=true",
                 f'elastic.schedule=["{args.join} join 1", "{args.leave} leave 1"]',
                 f"run_dir={run_dir}", *args.overrides]
    print(f"# bench/elastic.py on {platform.node()} ({os.cpu_count()} CPUs), python "
          f"{sys.version.split()[0]}; overrides {overrides}")
    config = load_config(overrides=overrides)
    summary = json.loads(train(config).read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()][1:]
    rows = [{"step": m["step"], "worker1": m.get("elastic_states", {}).get("1", "rollout"),
             "replicas": int(m.get("replicas_joined", 0)), "step_s": m["step_s"],
             "rollout_s": m["rollout_s"], "train_s": m["train_s"], "elastic_s": m["elastic_s"]}
            for m in steps]
    print("| step | worker 1 | replicas | step s | rollout s | train s | driver s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['worker1']} | {r['replicas']} | {r['step_s']:.2f} | "
              f"{r['rollout_s']:.2f} | {r['train_s']:.2f} | {r['elastic_s']:.4f} |")
    moving = [r["step_s"] for r in rows if r["worker1"] not in ("rollout", "active")]
    still = [r["step_s"] for r in rows if r["worker1"] in ("rollout", "active")]
    bound = {"driver_s_max": max(r["elastic_s"] for r in rows),
             "step_s_median_while_moving": statistics.median(moving) if moving else None,
             "step_s_median_otherwise": statistics.median(still) if still else None,
             "trained_every_step": [m["version"] for m in steps] == list(
                 range(1, len(steps) + 1))}
    print(f"# bound: {bound}")
    (out / "elastic_timeline.json").write_text(json.dumps(
        {"overrides": overrides, "rows": rows, "bound": bound,
         "transitions": summary["elastic"]["timeline"]}, indent=2))
    try:
        plot(rows, out / "elastic_timeline.png")
        print(f"# wrote {out / 'elastic_timeline.json'} and {out / 'elastic_timeline.png'}")
    except ImportError:
        print(f"# wrote {out / 'elastic_timeline.json'} (pip install matplotlib for the PNG)")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"requested": "#fdd", "fetching_state": "#fec", "zero_sync": "#ffc",
              "activating": "#dfd", "active": "#cfc", "releasing": "#cef",
              "loading_weights": "#ddf"}
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        if r["worker1"] in colors:
            ax.axvspan(r["step"] - 0.5, r["step"] + 0.5, color=colors[r["worker1"]], lw=0)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["step_s"] for r in rows], marker="o", label="step s")
    ax.plot(steps, [r["train_s"] for r in rows], marker=".", label="train s")
    ax.plot(steps, [r["elastic_s"] for r in rows], marker="x", label="driver s")
    for state, color in colors.items():
        ax.plot([], [], color=color, lw=8, label=f"worker 1 {state}")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

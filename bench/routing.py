"""Rollout routing policies side by side: modes/bucket (two rollout workers, a
short and a long bucket, one-step K = 1) with routing.policy set to Libra's bucket router, its
baselines, and none (the version assignment alone), each from the same warm start, seed and
wall-clock budget, one after another in one invocation.

    python bench/routing.py [--seconds 60] [--policies bucket,fifo,least_load,round_robin,none]
                            [--out bench/results/routing] [key=value ...]

Prints how it was run and a table (training samples/s, generated tokens/s, rollout idle
fraction, requests moved by the router, moves blocked by C1 or the pool, tokens each worker
generated, held-out accuracy at the end), and writes results.json into --out. Extra key=value
overrides apply to every policy. Not part of the test suite: a minute or more per policy.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
POLICIES = ("bucket", "fifo", "least_load", "round_robin", "none")


def main() -> int:
    from modes import _fmt, summarize

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "routing"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from eddyrl.config import bundled, load_config
    from eddyrl.launch import train

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    common = [f"loop.max_seconds={args.seconds}", "loop.steps=100000", "loop.eval_every=0",
              *args.overrides]
    mode = bundled("modes/bucket")  # eddyrl/configs/modes/bucket.yaml
    print(f"# bench/routing.py on {platform.node()} ({os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}), python {sys.version.split()[0]}")
    print(f"# modes/bucket with routing.policy in {policies}; budget "
          f"{args.seconds:.0f} s of training each; overrides {common}")
    results = {}
    for policy in policies:
        run_dir = out / policy
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: eddy train refuses to append
        config = load_config(mode, [*common, f"routing.policy={policy}", f"run_dir={run_dir}"])
        began = time.monotonic()
        summary = json.loads(train(config).read_text())
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        row = summarize(metrics, summary, target=1.0, marks=[])
        routing = summary.get("routing", {})
        row.update(moves=routing.get("moves", 0), blocked=routing.get("blocked_moves", 0),
                   worker_tokens=summary.get("rollout_worker_tokens"))
        results[policy] = row
        print(f"# {policy}: done in {time.monotonic() - began:.0f} s", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    columns = ["steps", "samples_per_s", "gen_tokens_per_s", "rollout_idle_fraction",
               "staleness_mean", "moves", "blocked", "worker_tokens", "final_accuracy"]
    print("| policy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for policy, r in results.items():
        print(f"| {policy} | " + " | ".join(_fmt(r[c]) for c in columns) + " |")
    print(f"# wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

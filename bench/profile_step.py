"""One RL step of the default run, role by role, in one process: where the time goes.

    python bench/profile_step.py [--steps 6] [--threads 2] [--hogs 0] [--ops 12]

Builds the default run's pieces directly (no Ray): the `hf` engine on the bundled warm start,
16 prompts x 8 samples of the arithmetic task (54 new tokens, temperature 1), the reward, the
training batch, and the FSDP trainer on one rank. Then, `--steps` times: generate, score,
build the batch, the trainer's log-prob pass (`compute_logprobs`: what a run with
`train.mini_batches` > 1 or the decoupled loss does before its update; the default run takes the
pre-update log-probs from the update's own forward), the update (`train_step`), and the weight
export into the engine. Prints
the median and p90 of each phase over the steps after the first (warm-up), and a
torch.profiler table of the update's top ops. `--hogs N` runs N busy loops beside it (ended
by their PIDs). Timings are wall-clock on a shared machine: compare within one invocation.

OpenMP's waiting is Eddy's (GOMP_SPINCOUNT=0, set by `import eddyrl`) unless the environment
says otherwise: `GOMP_SPINCOUNT=300000 python bench/profile_step.py` measures GNU OpenMP's
default spinning.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eddyrl  # noqa: E402,F401  (before torch: it sets how OpenMP threads wait)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hogs", type=int, default=0)
    parser.add_argument("--ops", type=int, default=12, help="rows of the op table (0: none)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="train.micro_batch_size (default: the default config's)")
    args = parser.parse_args()

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hogs)]
    try:
        run(args)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def run(args) -> None:
    import torch

    from eddyrl.config import load_config
    from eddyrl.core.batching import build_train_batch
    from eddyrl.core.update import PolicyUpdate
    from eddyrl.engines.inference.hf import HFInferenceEngine
    from eddyrl.engines.training.fsdp import FSDPTrainEngine
    from eddyrl.hal import get_platform
    from eddyrl.models.config import load_tokenizer
    from eddyrl.protocol import GenerationRequest, Group, SamplingParams, Trajectory
    from eddyrl.tasks.arith import ArithTaskConfig, generate_rows
    from eddyrl.tasks.prompts import prompt_ids
    from eddyrl.tasks.reward import reward

    torch.set_num_threads(args.threads)
    config = load_config()
    model_path = config.model.resolve()
    tokenizer = load_tokenizer(model_path)
    platform = get_platform("cpu")
    rows = generate_rows(config.loop.batch_prompts * args.steps, 0, "train", ArithTaskConfig())
    sampling = SamplingParams(max_new_tokens=config.rollout.max_new_tokens,
                              temperature=config.rollout.temperature,
                              stop_token_ids=(tokenizer.eos_token_id,))
    engine = HFInferenceEngine(model_path, platform, seed=0,
                               max_batch_size=config.rollout.max_batch_size)
    rendezvous = tempfile.mkdtemp(prefix="profile-")
    trainer = FSDPTrainEngine(model_path, platform, rank=0, world_size=1,
                              init_method=f"file://{rendezvous}/group", lr=config.train.lr,
                              micro_batch_size=args.micro_batch or config.train.micro_batch_size,
                              temperature=config.rollout.temperature,
                              share_prompts=config.train.share_prompts,
                              max_packed_tokens=config.train.max_packed_tokens)
    loss_fn = PolicyUpdate(config.algorithm).loss
    n, k = config.rollout.n_samples, config.loop.batch_prompts
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        start = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - start)
        return out

    async def generate(prompts):
        requests = [GenerationRequest(f"{i}.{s}", ids, sampling)
                    for i, ids in enumerate(prompts) for s in range(n)]
        return [r async for r in engine.generate(requests) if r.final]

    profile_batch = None
    for step in range(args.steps):
        batch_rows = rows[step * k:(step + 1) * k]
        prompts = [list(prompt_ids(tokenizer, row["prompt"])) for row in batch_rows]
        results = timed("generate", lambda: asyncio.run(generate(prompts)))
        by_prompt: dict[int, list] = {}
        for result in results:
            by_prompt.setdefault(int(result.request_id.split(".")[0]), []).append(result)
        groups = timed("score", lambda: [
            Group(str(i), row["prompt"], row["answer"], prompts[i], step,
                  [Trajectory(r, reward(tokenizer.decode(r.token_ids, skip_special_tokens=True),
                                        row["answer"])) for r in by_prompt[i]])
            for i, row in enumerate(batch_rows)])
        groups = [g for g in groups if g.is_informative()] or groups
        batch = timed("batch", lambda: build_train_batch(groups, tokenizer.pad_token_id))
        timed("logprobs", lambda: trainer.compute_logprobs(batch))
        timed("train_step", lambda: trainer.train_step(batch, loss_fn))
        timed("weights", lambda: asyncio.run(engine.load_weights(
            step + 1, list(trainer.export_weights(config.train.bucket_mb << 20)))))
        profile_batch = batch

    print(f"# bench/profile_step.py --steps {args.steps} --threads {args.threads} "
          f"--hogs {args.hogs} --micro-batch {args.micro_batch}; GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}; "
          f"{os.cpu_count()} cores; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; batch {len(profile_batch)} rows x "
          f"{profile_batch.input_ids.shape[1]} tokens")
    total = 0.0
    for name, values in times.items():
        warm = values[1:] or values
        median = statistics.median(warm)
        total += median
        p90 = sorted(warm)[min(len(warm) - 1, int(0.9 * len(warm)))]
        print(f"{name:>11}: median {median * 1000:8.1f} ms   p90 {p90 * 1000:8.1f} ms")
    print(f"{'step':>11}: {total * 1000:8.1f} ms (sum of the medians)")
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(profile_batch, loss_fn)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))


if __name__ == "__main__":
    main()

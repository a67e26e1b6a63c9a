"""What buddy replication costs a training step (engines/training/buddy.py): the FSDP engine on
two CPU ranks (gloo), with and without `buddy_replication`, side by side in one invocation.

    python bench/buddy_replication.py [--models tiny,Qwen3-0.6B] [--layers 2] [--steps 6]
                                      [--rows 4] [--length 64] [--repeats 2] [--out FILE.json]

Models: `tiny` (the embedded tiny Qwen3) and any shape in eddyrl/assets/shapes/ (its real
config.json, cut to --layers decoder layers, random weights: the real embedding and layer
sizes, few layers). Each rank trains --steps steps (after one warm-up step) on --rows rows of
--length random tokens. Per step: its wall time (the mean over steps and ranks); with
replication, the part on the critical path (`copy_s`: the shard's copy into the staging buffer
right after the optimizer step; `wait_s`: waiting for the previous round at the next step's
end), the background transfer (`transfer_s`: the copy landing, then the exchange with the
buddy over gloo) and the host bytes per rank (staging buffer + the ward's copy), against the
rank's own shard bytes (parameters + optimizer state). Runs without and with replication
alternate --repeats times (each a fresh pair of ranks); the means are reported, each run too.
On a CPU platform host and device are
one memory: the copy is a memcpy on the trainer's thread, and the transfer's thread shares the
cores with the compute, so this is the mechanism's cost where it is highest; on an accelerator
the copy is an asynchronous device-to-host copy and the cores are the host's.
CPU; not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eddyrl.core.losses import make_policy_loss  # noqa: E402
from eddyrl.engines.training.shard_copy import shard_state  # noqa: E402
from eddyrl.engines.training.fsdp import FSDPTrainEngine  # noqa: E402
from eddyrl.hal import get_platform  # noqa: E402
from eddyrl.protocol import TrainBatch  # noqa: E402

WORLD = 2
SHAPES = ROOT / "eddyrl" / "assets" / "shapes"
LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.0)


def build_model(name: str, layers: int, directory: str) -> tuple[str, int]:
    """The model's directory and its vocabulary size."""
    if name == "tiny":
        from eddyrl.models.tiny import build_tiny_model, build_tokenizer

        tokenizer = build_tokenizer()
        model = build_tiny_model(tokenizer, 0)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        return directory, model.config.vocab_size
    from transformers import AutoConfig, AutoModelForCausalLM

    full = json.loads((SHAPES / name / "config.json").read_text())
    full.update(num_hidden_layers=layers,
                max_window_layers=min(full.get("max_window_layers", layers), layers))
    if "layer_types" in full:  # one per layer
        full["layer_types"] = full["layer_types"][:layers]
    os.makedirs(directory, exist_ok=True)
    (Path(directory) / "config.json").write_text(json.dumps(full))
    config = AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory, config.vocab_size


def random_batch(rows: int, length: int, vocab: int, seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    response = torch.zeros(rows, length)
    response[:, length // 2:] = 1.0
    return TrainBatch(
        input_ids=torch.randint(vocab, (rows, length), generator=gen),
        attention_mask=torch.ones(rows, length, dtype=torch.long), loss_mask=response,
        old_logprobs=-5.0 * response, advantages=torch.randn(rows, 1, generator=gen) * response,
        sample_weights=torch.ones(rows), versions=torch.where(response > 0, 0, -1))


def rank_main(rank, model_dir, init_file, vocab, args, replication, out):
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    platform = get_platform("cpu")
    engine = FSDPTrainEngine(model_dir, platform, rank, WORLD, f"file://{init_file}", lr=1e-5,
                             micro_batch_size=args.rows, seed=0,
                             buddy_replication=replication)
    batch = random_batch(args.rows, args.length, vocab, seed=rank)
    steps, parts = [], {"copy_s": [], "wait_s": [], "transfer_s": []}
    try:
        engine.train_step(batch, LOSS)  # warm-up: the optimizer state, the buddy's group
        engine.snapshot()
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.train_step(batch, LOSS)
            engine.snapshot()  # as the trainer rank takes one after each RL step
            steps.append(time.perf_counter() - start)
            if engine.buddy is not None:
                stats = engine.buddy.stats  # wait and copy of this step; transfer: the last
                parts["copy_s"].append(stats.copy_s)
                parts["wait_s"].append(stats.wait_s)
        own = sum(t.numel() * t.element_size() for key, t in
                  shard_state(engine.model, engine.optimizer, platform)
                  if not key.startswith("rng/"))
        result = {"step_s": steps, "own_shard_bytes": own}
        if engine.buddy is not None:
            engine.buddy.flush()
            stats = engine.buddy.stats
            result.update({k: v for k, v in parts.items() if v},
                          transfer_s_mean=stats.totals["transfer_s"] / stats.rounds,
                          host_bytes=stats.host_bytes, rounds=stats.rounds)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        engine.close()


def run(model_dir: str, vocab: int, args, replication: bool, work: str) -> list[dict]:
    here = tempfile.mkdtemp(dir=work)  # each run its own rendezvous file and results
    out = os.path.join(here, "result")
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(rank_main, args=(model_dir, os.path.join(here, "init"), vocab,
                                        args, replication, out),
                       nprocs=WORLD, join=True, start_method=method)
    results = []
    for rank in range(WORLD):
        with open(f"{out}.{rank}") as f:
            results.append(json.load(f))
    return results


def summary(results: list[dict]) -> dict:
    def mean(key):
        values = [v for r in results for v in r.get(key, [])]
        return statistics.mean(values) if values else None

    row = {"step_s": mean("step_s"), "own_shard_bytes": max(r["own_shard_bytes"]
                                                            for r in results)}
    if "host_bytes" in results[0]:
        row.update(copy_s=mean("copy_s"), wait_s=mean("wait_s"),
                   transfer_s=statistics.mean(r["transfer_s_mean"] for r in results),
                   host_bytes=max(r["host_bytes"] for r in results))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,Qwen3-0.6B")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2,
                        help="off / on runs, alternated (the machine's load drifts)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"host": host.processor() or host.machine(), "cores": os.cpu_count(),
              "torch": torch.__version__, "world": WORLD, "steps": args.steps,
              "rows": args.rows, "length": args.length, "layers": args.layers, "models": {}}
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            model_dir, vocab = build_model(name, args.layers, os.path.join(work, name))
            runs = {"off": [], "on": []}
            for _ in range(args.repeats):
                for mode in runs:
                    runs[mode].append(summary(run(model_dir, vocab, args, mode == "on", work)))
            rows = {mode: {key: statistics.mean(r[key] for r in results) for key in results[0]}
                    for mode, results in runs.items()}
            report["models"][name] = {**rows, "runs": runs}
            off, on = rows["off"], rows["on"]
            print(f"{name}: step {off['step_s'] * 1e3:.1f} ms off, {on['step_s'] * 1e3:.1f} ms "
                  f"on ({(on['step_s'] / off['step_s'] - 1) * 100:+.1f} %); critical path: "
                  f"copy {on['copy_s'] * 1e3:.2f} ms + wait {on['wait_s'] * 1e3:.2f} ms; "
                  f"transfer {on['transfer_s'] * 1e3:.1f} ms in the background; host "
                  f"{on['host_bytes'] / 2**20:.1f} MiB per rank for a "
                  f"{on['own_shard_bytes'] / 2**20:.1f} MiB shard", flush=True)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

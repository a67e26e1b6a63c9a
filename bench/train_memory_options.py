"""The training engine's memory settings side by side: step time and peak memory of one FSDP2
step under each activation checkpointing (none / full / selective) and offload (none /
optimizer / all).

    python bench/train_memory_options.py [--hidden 1024] [--layers 2] [--vocab 32768]
        [--rows 2] [--seq-len 1024] [--steps 2] [--threads 2]
        [--variants none full selective optimizer all]

A Qwen3-shaped model with random weights (hidden 1024, heads of 128 with 16 query and 8 KV
heads, MLP 3x wide, tied embeddings; `--vocab` 32768 by default, 151936 is Qwen3's but its
[tokens, vocab] logits alone are 1.2 GB per 2K tokens in fp32 on a machine with 6 GB a process)
is saved to a temporary directory once; each variant then runs in a process of its own, one at
a time: the real `FSDPTrainEngine` on one rank (gloo, CPU), `--rows` rows of `--seq-len` tokens
in one micro-batch (half prompt, half response), the config's default log-prob chunk. A warm-up
step first (AdamW's moments exist, as in every step after the first), then `--steps` timed
steps; each reports its wall time and its peak resident memory over the resident memory just
before it (`5` into /proc/self/clear_refs resets the peak, VmHWM reads it). Processes run with
glibc's mmap threshold fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_`) so a freed tensor leaves the
resident set (as bench/memory.py does).

A variant is a `+`-joined set of settings: `none`, `full`, `selective` (activation
checkpointing), `optimizer`, `all` (offload), e.g. `selective+optimizer`.

On a CPU the host and the device are one memory: offload cannot lower the peak and its moves are
no-ops or copies within host memory, so the offload rows measure only the code path's overhead
(the hooks, FSDP2's offload policy, the optimizer on the "host"). Checkpointing's rows are real:
the activations it drops and the recompute it pays. Wall times on a shared machine: compare
within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # process_memory.py beside it
from process_memory import reset_peak, status_bytes  # noqa: E402

MMAP_THRESHOLD = 64 * 1024
CHECKPOINTING = ("full", "selective")
OFFLOAD = ("optimizer", "all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+",
                        default=["none", "full", "selective", "optimizer", "all"])
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one variant
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_variant(args)), flush=True)
        return
    for variant in args.variants:
        settings(variant)  # refuse a bad name before any work
    print(f"$ python bench/train_memory_options.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"model: Qwen3-shaped, hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}, random init, fp32; batch: {args.rows} x {args.seq_len} tokens in one "
          f"micro-batch; {args.threads} threads; 1 warm-up + {args.steps} timed steps")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args, tmp)
        rows = []
        for variant in args.variants:
            rows.append(run_child(args, variant, model))
            print(format_row(rows[-1], rows[0]), flush=True)


def settings(variant: str) -> dict:
    """`full+optimizer` -> the engine's keyword arguments."""
    out = {"activation_checkpointing": "none", "offload": "none"}
    for part in variant.split("+"):
        if part in CHECKPOINTING:
            out["activation_checkpointing"] = part
        elif part in OFFLOAD:
            out["offload"] = part
        elif part != "none":
            raise SystemExit(f"variant {variant!r}: {part!r} is not one of none, "
                             f"{', '.join(CHECKPOINTING + OFFLOAD)}")
    return out


def build_model(args, tmp: str) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(args.hidden // 64, 2)  # head_dim 128, 2 query heads per KV head: Qwen3-0.6B's
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2,
                         head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=max(args.seq_len, 4096), dtype="float32")
    torch.manual_seed(0)
    path = os.path.join(tmp, "model")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def run_child(args, variant: str, model: str) -> dict:
    command = [sys.executable, __file__, "--child", variant, "--model", model,
               "--hidden", str(args.hidden), "--rows", str(args.rows),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--threads", str(args.threads), "--vocab", str(args.vocab)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"variant {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])



def run_variant(args) -> dict:
    import torch

    import eddyrl  # noqa: F401  (how OpenMP threads wait)
    from eddyrl.engines.config import TrainConfig
    from eddyrl.core.losses import make_policy_loss
    from eddyrl.engines.registry import load_engine_class
    from eddyrl.hal import get_platform
    from eddyrl.protocol import TrainBatch

    torch.set_num_threads(args.threads)
    options = settings(args.child)
    with tempfile.TemporaryDirectory() as tmp:
        engine = load_engine_class("train", "fsdp")(
            args.model, get_platform("cpu"), 0, 1, f"file://{tmp}/pg", lr=1e-5,
            micro_batch_size=args.rows, share_prompts=False,
            logprob_chunk_tokens=TrainConfig().logprob_chunk_tokens, **options)
        gen = torch.Generator().manual_seed(0)
        shape = (args.rows, args.seq_len)
        loss_mask = torch.zeros(shape)
        loss_mask[:, args.seq_len // 2:] = 1
        batch = TrainBatch(input_ids=torch.randint(0, args.vocab, shape, generator=gen),
                           attention_mask=torch.ones(shape, dtype=torch.long),
                           loss_mask=loss_mask, old_logprobs=-torch.rand(shape, generator=gen),
                           advantages=torch.randn(args.rows, 1, generator=gen) * loss_mask,
                           sample_weights=torch.ones(args.rows),
                           versions=torch.zeros(shape, dtype=torch.long))
        loss = make_policy_loss(clip_low=0.2, clip_high=0.28)
        engine.train_step(batch, loss)  # warm-up: AdamW's moments now exist
        times, peaks = [], []
        for _ in range(args.steps):
            baseline = reset_peak()
            start = time.perf_counter()
            engine.train_step(batch, loss)
            times.append(time.perf_counter() - start)
            peaks.append(status_bytes("VmHWM") - baseline)
        engine.close()
    return {"variant": args.child, **options, "step_s": statistics.median(times),
            "peak_over_baseline_mib": max(peaks) / 2 ** 20,
            "baseline_mib": baseline / 2 ** 20}


def format_row(row: dict, base: dict) -> str:
    time_ratio = row["step_s"] / base["step_s"]
    peak_ratio = row["peak_over_baseline_mib"] / base["peak_over_baseline_mib"]
    return (f"{row['variant']:>20}  step {row['step_s']:7.2f} s ({time_ratio:4.2f}x)  peak over "
            f"baseline {row['peak_over_baseline_mib']:8.1f} MiB ({peak_ratio:4.2f}x)  baseline "
            f"RSS {row['baseline_mib']:7.1f} MiB")


if __name__ == "__main__":
    main()

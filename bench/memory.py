"""Predicted vs measured peak memory of one FSDP2 training step (eddyrl/plan/training_memory.py).

    python bench/memory.py [--rows 0.6b,S2048] [--max-gib 6.5] [--dry-run] [--device] [--json FILE]

Each row is a Qwen3-shaped model with random weights (the 0.6B, 4B and 8B shapes of the real
config.json files, 1-4 decoder layers), saved to a temporary directory and trained for one
step by the real `FSDPTrainEngine` on one rank (a gloo group on the CPU): one sequence of S
tokens, one micro-batch, forward + backward + AdamW step, with the row's activation
checkpointing and log-prob chunk. Every row runs in a process of its own, one at a time.

Measured (CPU): the process's peak resident memory over its resident memory after the imports.
A warm-up step on a 16-token sequence first, so that AdamW's moments exist as in any step after
the first; then the peak is reset (`5` into /proc/self/clear_refs) and read back after the
step (VmHWM in /proc/self/status). The rows run with glibc's mmap threshold fixed at 64 KiB
(`MALLOC_MMAP_THRESHOLD_`): every tensor of 64 KiB or more is its own mapping, returned to
the OS when freed, so the resident set is the live tensors. With glibc's default the threshold
rises to the size of each freed block (up to 32 MiB), blocks below it come from the heap and
stay resident after they are freed, and the resident set is the live tensors plus that cache
(`--glibc-default` shows it).

Measured (`--device`): the accelerator allocator's peak (the HAL's `reset_peak_memory` and
`memory_info().peak_allocated`) over what it held before the engine was built, with the compute
dtype bf16 and the platform's optimizer (foreach AdamW); rows run where the accelerator has
the memory. Without an accelerator `--device` says so and exits 0.

Rows predicted above `--max-gib` (default 6.5: the shared CPU machine's ~6 GiB per process)
are not run, and say so. `--dry-run` prints the predicted table only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # process_memory.py beside it
from process_memory import reset_peak, status_bytes  # noqa: E402

from eddyrl.engines.config import LORA_TARGETS  # noqa: E402
from eddyrl.plan.shapes import ModelShape, shape_from_config  # noqa: E402
from eddyrl.plan.training_memory import (TrainingMemory, TrainingOptions,  # noqa: E402
                                         training_memory)

GIB = 1 << 30
# The real models' config.json values (Qwen/Qwen3-0.6B, -4B, -8B); layers are the row's.
QWEN3 = dict(model_type="qwen3", num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
             max_position_embeddings=40960, attention_bias=False)
SHAPES = {
    "0.6b": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 tie_word_embeddings=True),
    "4b": dict(QWEN3, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
    "8b": dict(QWEN3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False),
    # not a real model: a row in seconds, for tests/fast/plan/test_memory_bench.py
    "small": dict(QWEN3, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=32768,
                  tie_word_embeddings=True),
}
MMAP_THRESHOLD = 64 << 10
MAX_GIB = 6.5  # a row's process on the shared CPU machine: ~6 GiB
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class Row:
    shape: str
    layers: int
    tokens: int
    checkpointing: str = "none"
    chunk: int = 0  # logprob_chunk_tokens; 0: the whole sequence at once
    shared: int = 0  # n > 0: n responses sharing one prompt, packed with a dense mask
    lora: int = 0  # LoRA rank on every linear of the layers; 0: full training

    @property
    def name(self) -> str:
        extra = (f" mask/{self.shared}" if self.shared else "") + (
            f" lora={self.lora}" if self.lora else "")
        return (f"{self.shape} L{self.layers} S{self.tokens} ac={self.checkpointing} "
                f"chunk={self.chunk}{extra}")

    def config(self) -> dict:
        return dict(SHAPES[self.shape], num_hidden_layers=self.layers)

    def model_shape(self) -> ModelShape:
        return shape_from_config(self.config(), f"{self.shape} shape")


def default_rows() -> list[Row]:
    """Cheapest first: on two shared CPU cores the LM head over 151,936 words is most of a
    step (~1 TFLOP per 1K tokens of 0.6B), a minute or more per 1K tokens."""
    rows = [Row("0.6b", 1, 1024), Row("0.6b", 4, 1024), Row("0.6b", 1, 1024, chunk=256),
            Row("0.6b", 4, 2048, chunk=512), Row("0.6b", 4, 2048, "full", 512),
            Row("0.6b", 4, 2048, "selective", 512), Row("0.6b", 2, 4096, "full", 1024),
            Row("0.6b", 2, 4096, "none", 1024, shared=4), Row("4b", 1, 1024, lora=16),
            Row("0.6b", 1, 8192, "full", 1024), Row("0.6b", 1, 16384, "full", 1024)]
    for shape in ("4b", "8b"):
        rows += [Row(shape, 1, 1024), Row(shape, 2, 4096, "full", 1024),
                 Row(shape, 4, 16384, "full", 1024)]
    return rows


def predict(row: Row, device: bool) -> TrainingMemory:
    """The plan for `row` as the bench runs it: one micro-batch of one unmasked row (the row
    layout: sdpa runs causal with no mask) or of one shared-prompt pack (its dense mask), fp32
    and per-tensor AdamW on the CPU, bf16 and foreach AdamW on an accelerator."""
    return training_memory(row.model_shape(), TrainingOptions(
        tokens_per_micro_batch=row.tokens, param_dtype="bf16" if device else "fp32",
        activation_checkpointing=row.checkpointing, logprob_chunk_tokens=row.chunk,
        attention="mask" if row.shared else "flash", gradient_accumulation=False,
        foreach_optimizer=device, lora_rank=row.lora,
        lora_targets=LORA_TARGETS if row.lora else ()))


# ---- one row, in its own process -------------------------------------------------------------

def _batch(tokens: int, vocab: int, seed: int = 0, shared: int = 0):
    """One row of `tokens` random tokens; or (`shared` = n) n rows of one prompt of
    tokens / 8 tokens and responses that fill a pack of `tokens`, their prompt lengths given
    so that the engine packs them (packing.py's shared-prompt layout, a dense [S, S] mask)."""
    import torch

    from eddyrl.protocol import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    rows, prompt = max(shared, 1), tokens // 8 if shared else 0
    width = prompt + (tokens - prompt) // rows if shared else tokens
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    ids[:, :prompt] = ids[0, :prompt]
    loss_mask = torch.ones(rows, width)
    loss_mask[:, :max(prompt, 1)] = 0
    return TrainBatch(input_ids=ids, attention_mask=torch.ones(rows, width, dtype=torch.long),
                      loss_mask=loss_mask,
                      old_logprobs=-torch.rand(rows, width, generator=gen) * loss_mask,
                      advantages=torch.randn(rows, width, generator=gen) * loss_mask,
                      sample_weights=torch.ones(rows),
                      versions=torch.where(loss_mask > 0, 0, -1),
                      prompt_lengths=torch.full((rows,), prompt) if shared else None)


def measure_row(row: Row, model_dir: str, device: bool) -> dict:
    """Run one step of `row` in this process; the peak over the baseline, in bytes."""
    import torch

    from eddyrl.core.losses import make_policy_loss
    from eddyrl.hal import get_platform

    loss = make_policy_loss(clip_low=0.2, clip_high=0.28)
    platform = get_platform(None if device else "cpu")
    if not device:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    _save_model(row.config(), model_dir)
    tmp = tempfile.mkdtemp(prefix="eddy-memory-")
    platform.init_process_group(0, 1, f"file://{tmp}/init", 600.0, local=True)
    _warm_up(row, platform, device, tmp, loss)
    baseline = _held(platform, device)
    engine = _engine(row, model_dir, platform, device)
    built = _held(platform, device) - baseline
    vocab = SHAPES[row.shape]["vocab_size"]
    engine.train_step(_batch(WARMUP_TOKENS, vocab, seed=1), loss)  # AdamW's moments
    batch = _batch(row.tokens, vocab, shared=row.shared)
    before = _held(platform, device) - baseline
    start = time.perf_counter()
    if device:
        platform.synchronize()
        platform.reset_peak_memory()
        engine.train_step(batch, loss)
        platform.synchronize()
        peak = platform.memory_info().peak_allocated
    else:
        reset_peak()
        engine.train_step(batch, loss)
        peak = status_bytes("VmHWM")
    seconds = time.perf_counter() - start
    engine.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return {"measured": peak - baseline, "seconds": seconds, "built": built,
            "before_step": before}


def _engine(row: Row, model_dir: str, platform, device: bool):
    from eddyrl.engines.config import LoraConfig
    from eddyrl.engines.training.fsdp import FSDPTrainEngine

    # the process group is the one joined in measure_row (the engine then leaves it alone)
    return FSDPTrainEngine(
        model_dir, platform, 0, 1, "unused", lr=1e-4,
        micro_batch_size=max(row.shared, 1), param_dtype="bf16" if device else None,
        share_prompts=bool(row.shared), attention="mask" if row.shared else "auto",
        activation_checkpointing=row.checkpointing, logprob_chunk_tokens=row.chunk,
        max_packed_tokens=max(row.tokens, 8192),
        lora=LoraConfig(rank=row.lora) if row.lora else None)


def _warm_up(row: Row, platform, device: bool, tmp: str, loss) -> None:
    """One step of the row's settings on a miniature of its model (1 layer, hidden 64, vocab
    256), before the baseline: what a process spends once, not per tensor, stays out of the
    measurement. On the CPU that is ~150 MB of code and data of the modules transformers,
    FSDP and autograd import lazily (the model's modeling module at its first build, more at
    the first step) and ~40 MB that the first step adds besides (OpenMP's thread pool, the
    autograd engine, kernel caches); the same for every row, whatever its size."""
    import gc

    config = dict(row.config(), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=256)
    path = os.path.join(tmp, "miniature")
    _save_model(config, path)
    engine = _engine(dataclasses.replace(row, tokens=64), path, platform, device)
    for _ in range(2):
        engine.train_step(_batch(64, 256, shared=row.shared), loss)
    engine.close()
    del engine
    gc.collect()


def _save_model(config: dict, path: str) -> None:
    """A random-init model of `config` at `path`, unless one is there already."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    torch.manual_seed(0)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _held(platform, device: bool) -> int:
    return platform.memory_info().allocated if device else status_bytes("VmRSS")


# ---- the table ------------------------------------------------------------------------------
def _model_dir(row: Row, root: Path) -> str:
    """Where the row's random-init model is saved (by the first row that needs it)."""
    return str(root / f"{row.shape}-L{row.layers}")


def _run_child(row: Row, model_dir: str, device: bool, glibc_default: bool) -> dict:
    env = dict(os.environ)
    if not glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    args = [sys.executable, __file__, "--child", json.dumps(dataclasses.asdict(row)),
            "--model-dir", model_dir] + (["--device"] if device else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="",
                        help="only rows whose name contains one of these (comma-separated)")
    parser.add_argument("--max-gib", type=float, default=MAX_GIB)
    parser.add_argument("--dry-run", action="store_true", help="the predicted table only")
    parser.add_argument("--device", action="store_true", help="the accelerator's allocator")
    parser.add_argument("--glibc-default", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_row(Row(**json.loads(args.child)), args.model_dir,
                                     args.device)))
        return 0
    if args.device:
        from eddyrl.hal.registry import detect

        platform = detect()
        if platform.name == "cpu":
            print("--device: no accelerator here; nothing measured")
            return 0
        args.max_gib = min(args.max_gib if args.max_gib != MAX_GIB else 1e9,
                           platform.device_memory_bytes() * 0.9 / GIB)

    wanted = args.rows.split(",")
    rows = [r for r in default_rows() if any(part in r.name for part in wanted)]
    print(f"{'row':<40} {'predicted':>9} {'measured':>9} {'error':>7}  moment / note")
    results = []
    with tempfile.TemporaryDirectory(prefix="eddy-memory-") as tmp:
        for row in rows:
            plan = predict(row, args.device)
            result = {"row": row.name, "predicted": plan.peak, "moment": plan.moment,
                      "terms": {k: v for k, v in plan.as_dict().items()
                                if isinstance(v, int) and k != "peak"}}
            if args.dry_run or plan.peak > args.max_gib * GIB:
                note = ("dry run" if args.dry_run else
                        f"skipped: predicted over --max-gib {args.max_gib:g}")
                print(f"{row.name:<40} {_gib(plan.peak)} {'':>9} {'':>7}  {plan.moment}; {note}",
                      flush=True)
                results.append(dict(result, skipped=note))
                continue
            got = _run_child(row, _model_dir(row, Path(tmp)), args.device, args.glibc_default)
            if "error" in got:
                print(f"{row.name:<40} {_gib(plan.peak)} {'failed':>9} {'':>7}  {got['error']}",
                      flush=True)
                results.append(dict(result, error=got["error"]))
                continue
            error = (plan.peak - got["measured"]) / got["measured"]
            print(f"{row.name:<40} {_gib(plan.peak)} {_gib(got['measured'])} {error:+7.1%}  "
                  f"{plan.moment}; step {got['seconds']:.0f} s", flush=True)
            results.append(dict(result, measured=got["measured"], error=error,
                                seconds=got["seconds"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

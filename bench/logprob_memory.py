"""Peak memory and time of the LM head's log-probs, forward + backward: the straightforward path
against the chunked head (eddyrl/engines/training/logprob.py), side by side.

    python bench/logprob_memory.py [--hidden 1024] [--vocab 151936] [--tokens 2048,4096,8192]
                                   [--variants plain,0,1024,4096] [--dtype fp32|bf16]
                                   [--temperature 1.0] [--max-gib 6] [--threads 0]

Only the head, as the training step runs it: hidden states [tokens, hidden] (the final norm's
output) and the LM head's weight [vocab, hidden] (Qwen3's vocabulary by default), both
requiring gradients; the log-prob of one target per token at the temperature; a backward from
their sum. Variants:
  plain   the engine before the chunked head: logits = hidden @ W.T, their fp32 log-softmax over
          the vocabulary, a gather (`_scaled` in packing.py then), log-probs only;
  N       head_logprobs with chunk_tokens = N (0: the whole input as one chunk), which also
          gives each token's entropy.
Every (variant, tokens) row runs in a process of its own, one at a time, with glibc's mmap
threshold at 64 KiB (`MALLOC_MMAP_THRESHOLD_`), so a freed tensor leaves the resident set.
Measured: the process's peak resident memory (VmHWM in /proc/self/status, reset by `5` into
/proc/self/clear_refs) over its resident memory just before the forward, inputs and a small
warm-up call already in it: what the forward and backward add, the weight's gradient included.
Time: wall seconds of that forward + backward. Rows predicted above --max-gib are skipped and
say so. CPU only (this is the shared CPU machine's measurement); not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # process_memory.py beside it
from process_memory import reset_peak, status_bytes  # noqa: E402

MMAP_THRESHOLD = 64 * 1024
GIB = 1 << 30
# [tokens, vocab] fp32 buffers alive at the peak, to skip rows that would not fit (the table
# measures them): plain, e.g. the log-softmax kept for the backward and the gradients through
# it; chunked, a chunk's log p and p (forward), or log p and the gradient (backward)
PLAIN_BUFFERS, CHUNK_BUFFERS = 4, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", default="2048,4096,8192")
    parser.add_argument("--variants", default="plain,0,1024,4096")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-gib", type=float, default=6.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.one[0], int(args.one[1]))))
        return
    print("command: python " + " ".join(sys.argv))
    print(f"head: hidden {args.hidden}, vocab {args.vocab}, {args.dtype} weights and hidden "
          f"states, temperature {args.temperature}; each row its own process, one at a time")
    print(f"{'variant':>8} {'tokens':>7} {'peak MiB':>9} {'seconds':>8}  note")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for variant in args.variants.split(","):
            predicted = _predicted_bytes(args, variant, tokens)
            if predicted > args.max_gib * GIB:
                print(f"{variant:>8} {tokens:>7} {'-':>9} {'-':>8}  skipped: predicted "
                      f"{predicted / GIB:.1f} GiB > --max-gib {args.max_gib}")
                continue
            row = _run_child(args, variant, tokens)
            print(f"{variant:>8} {tokens:>7} {row['peak'] / (1 << 20):>9.0f} "
                  f"{row['seconds']:>8.2f}  predicted {predicted / GIB:.1f} GiB", flush=True)


def _predicted_bytes(args, variant: str, tokens: int) -> float:
    rows = tokens if variant in ("plain", "0") else min(tokens, int(variant))
    buffers = PLAIN_BUFFERS if variant == "plain" else CHUNK_BUFFERS
    return buffers * rows * args.vocab * 4 + args.vocab * args.hidden * 4  # + the weight's grad


def _run_child(args, variant: str, tokens: int) -> dict:
    command = [sys.executable, __file__, "--hidden", str(args.hidden), "--vocab",
               str(args.vocab), "--dtype", args.dtype, "--temperature", str(args.temperature),
               "--threads", str(args.threads), "--one", variant, str(tokens)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(args, variant: str, tokens: int) -> dict:
    import torch

    from eddyrl.engines.training.logprob import head_logprobs

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(dtype)
    weight.requires_grad_()
    hidden = torch.randn(tokens, args.hidden, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (tokens,), generator=gen)

    def step(h: torch.Tensor, t: torch.Tensor) -> None:
        if variant == "plain":
            logits = torch.nn.functional.linear(h, weight)
            logp = torch.log_softmax(logits.float() / args.temperature, dim=-1)
            logp.gather(-1, t[:, None]).sum().backward()
        else:
            logp, _ = head_logprobs(h, weight, None, t, args.temperature, int(variant))
            logp.sum().backward()
        weight.grad = None
        h.grad = None

    step(hidden[:16].detach().requires_grad_(), targets[:16])  # kernels, thread pools
    baseline = reset_peak()
    start = time.perf_counter()
    step(hidden, targets)
    seconds = time.perf_counter() - start
    return {"peak": status_bytes("VmHWM") - baseline, "seconds": seconds}



if __name__ == "__main__":
    main()

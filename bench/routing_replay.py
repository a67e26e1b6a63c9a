"""Rollout routing replay (R3) against the train-inference mismatch it targets: the same
rollout batches scored by an fp32 trainer with and without replaying the rollout's experts,
side by side in one invocation.

    python bench/routing_replay.py [--model random|PATH] [--router-std 0.02] [--seed 0]
                                   [--prompts 16] [--samples 4] [--max-new-tokens 48]
                                   [--rollout-dtypes bf16,fp32] [--out FILE.json]

Model: `random`, the embedded tiny MoE (eddyrl/models/tiny_moe.py: 4 layers, 4 experts, top-2)
freshly initialised from --seed with its routers drawn at std --router-std (transformers'
init, 0.02, leaves router logits close: routing that bf16 flips easily), or a model directory
(e.g. eddyrl/assets/moe_warmstart, the SFT warm start). For each rollout dtype: the hf engine
generates --prompts held-out arith prompts (as a run renders them) x --samples responses at
temperature 1, recording each input token's experts; the FSDP trainer (fp32, one rank,
shared-prompt packing) computes the same batch's log-probs with the experts replayed and
without. Per trained token, log rho = trainer - rollout log-prob:
max |log rho|, mean |log rho| and KL(rollout || trainer) by the k3 estimator (as the loss's
`mismatch_kl`), and the share of (token, layer) routings where the trainer's own top-k set
differs from the rollout's. CPU; not part of the test suite (a minute or two).
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eddyrl.core.batching import build_train_batch  # noqa: E402
from eddyrl.core.losses import k3_kl  # noqa: E402
from eddyrl.engines.config import TORCH_DTYPE_NAMES  # noqa: E402
from eddyrl.engines.inference.hf import HFInferenceEngine  # noqa: E402
from eddyrl.engines.inference.routing import ExpertRecorder  # noqa: E402
from eddyrl.engines.training.fsdp import FSDPTrainEngine  # noqa: E402
from eddyrl.hal import get_platform  # noqa: E402
from eddyrl.protocol import GenerationRequest, Group, SamplingParams, Trajectory  # noqa: E402


def build_model(args, directory: str) -> str:
    if args.model != "random":
        return args.model
    from eddyrl.models.tiny import build_tokenizer
    from eddyrl.models.tiny_moe import build_tiny_moe_model

    tokenizer = build_tokenizer()
    model = build_tiny_moe_model(tokenizer, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * args.router_std)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompts(model_dir: str, count: int, seed: int) -> list[list[int]]:
    """The arith task's held-out prompts, rendered as a run renders them."""
    from transformers import AutoTokenizer

    from eddyrl.tasks.arith import ArithTaskConfig, generate_rows
    from eddyrl.tasks.prompts import prompts_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = generate_rows(count, seed, "eval", ArithTaskConfig())
    return prompts_ids(tokenizer, [row["prompt"] for row in rows])


def rollout(model_dir: str, dtype: str, args) -> list[Group]:
    import asyncio

    engine = HFInferenceEngine(model_dir, get_platform("cpu"), seed=args.seed,
                               dtype=TORCH_DTYPE_NAMES[dtype], record_routing=True)
    asked = prompts(model_dir, args.prompts, args.seed)
    eos = engine.model.config.eos_token_id
    requests = [GenerationRequest(f"{p}.{s}", ids, SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=(eos,)))
        for p, ids in enumerate(asked) for s in range(args.samples)]

    async def run():
        return {r.request_id: r async for r in engine.generate(requests) if r.final}

    results = asyncio.run(run())
    return [Group(str(p), "", "", ids, 0, [Trajectory(results[f"{p}.{s}"], reward=float(s % 2))
                                           for s in range(args.samples)])
            for p, ids in enumerate(asked)]


def own_routing_disagreement(model_dir: str, batch) -> float:
    """Share of (input token, layer) whose fp32 top-k set differs from the recorded one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    recorder = ExpertRecorder(model)
    with torch.no_grad():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    own = recorder.take(*batch.input_ids.shape).long().sort(-1).values
    recorded = batch.routed_experts.long().sort(-1).values
    known = (recorded >= 0).all(-1)  # [B, L, layers]
    differ = (own != recorded).any(-1) & known
    return differ.sum().item() / max(known.sum().item(), 1)


def mismatch(logprobs: torch.Tensor, batch) -> dict:
    mask = batch.loss_mask.bool()
    log_rho = (logprobs - batch.old_logprobs)[mask].double()  # k3 in fp32 rounds below 0
    return {"max_abs": log_rho.abs().max().item(), "mean_abs": log_rho.abs().mean().item(),
            "kl_k3": k3_kl(log_rho).mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random")
    parser.add_argument("--router-std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rollout-dtypes", default="bf16,fp32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  python "
          f"{' '.join(sys.argv)}")
    print(f"# torch {torch.__version__}, {host.processor() or host.machine()}, "
          f"{torch.get_num_threads()} threads; trainer fp32, one rank, hf rollout engine")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args, tmp)
        trainer = FSDPTrainEngine(model_dir, get_platform("cpu"), 0, 1, f"file://{tmp}/init",
                                  micro_batch_size=16, seed=args.seed)
        try:
            for dtype in args.rollout_dtypes.split(","):
                batch = build_train_batch(rollout(model_dir, dtype, args), pad_id=0)
                replayed = trainer.compute_logprobs(batch)
                experts, batch.routed_experts = batch.routed_experts, None
                own = trainer.compute_logprobs(batch)
                batch.routed_experts = experts
                flips = own_routing_disagreement(model_dir, batch)
                tokens = int(batch.loss_mask.sum())
                for replay, logprobs in (("off", own), ("on", replayed)):
                    rows.append({"rollout_dtype": dtype, "replay": replay, "tokens": tokens,
                                 "routing_disagreement": flips, **mismatch(logprobs, batch)})
        finally:
            trainer.close()
    print(f"\n{'rollout':>8} {'replay':>6} {'tokens':>7} {'routing differs':>16} "
          f"{'max |log rho|':>14} {'mean |log rho|':>15} {'KL k3':>10}")
    for r in rows:
        print(f"{r['rollout_dtype']:>8} {r['replay']:>6} {r['tokens']:>7} "
              f"{r['routing_disagreement']:>16.4f} {r['max_abs']:>14.3e} "
              f"{r['mean_abs']:>15.3e} {r['kl_k3']:>10.3e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

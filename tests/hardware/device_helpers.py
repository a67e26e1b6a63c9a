"""Shared by the accelerator tests and the ranks they spawn: requests of different prompt lengths
(so the sampler left-pads), generation, a trainer at world size 1, and the log-prob tolerance."""

from __future__ import annotations

import asyncio

import torch

from eddyrl.core.losses import make_policy_loss
from eddyrl.protocol import GenerationRequest, SamplingParams
from eddyrl.engines.registry import load_engine_class

# Token ids of the tiny character vocabulary; lengths 5, 3, 8 and 2.
PROMPTS = ((1, 35, 33, 19, 5), (1, 20, 7), (1, 9, 9, 30, 31, 12, 8, 2), (1, 40))
LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)

# Largest |sampler - trainer| log-prob gap accepted, by torch's fp32 matmul precision. "highest"
# (torch's default; neither the HAL nor the engines change it) keeps fp32 GEMMs in full fp32, so
# the two engines differ only in kernels and summation order (cached q_len=1 steps against one
# causal pass, left against right padding): ~1e-5 on the tiny model; 1e-3 leaves a 100x margin
# and still catches a wrong position, temperature or mask, which move log-probs by 0.1 or more.
# TF32 ("high"/"medium") rounds matmul inputs to 10 mantissa bits (~1e-3 relative on logits).
LOGPROB_TOLERANCE = {"highest": 1e-3, "high": 5e-2, "medium": 5e-2}


def logprob_tolerance() -> tuple[str, float]:
    precision = torch.get_float32_matmul_precision()
    return precision, LOGPROB_TOLERANCE[precision]


def requests(prefix: str, max_new: int, temperature: float,
             prompts=PROMPTS) -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", list(prompt),
                              SamplingParams(max_new_tokens=max_new + 3 * i,
                                             temperature=temperature))
            for i, prompt in enumerate(prompts)]


def collect(engine, reqs: list[GenerationRequest]) -> list:
    """Every result of one generate call, by request id."""
    async def run():
        return [r async for r in engine.generate(reqs)]
    return sorted(asyncio.run(run()), key=lambda r: r.request_id)


def greedy(engine, max_new: int = 16) -> tuple[list[list[int]], list[list[float]]]:
    results = collect(engine, requests("greedy", max_new, temperature=0.0))
    return [r.token_ids for r in results], [r.logprobs for r in results]


def make_trainer(model_dir: str, platform, init_file: str, **overrides):
    """The FSDP engine at world size 1: its own process group, through the platform."""
    kwargs = dict(lr=1e-3, micro_batch_size=3, seed=0)
    kwargs.update(overrides)
    engine_class = load_engine_class("train", "fsdp")
    return engine_class(model_dir, platform, 0, 1, f"file://{init_file}", **kwargs)


def trained_weights(engine) -> dict[str, torch.Tensor]:
    """Full weights on the host (rank 0 of a one-rank trainer)."""
    return {k: v.detach().cpu().clone() for bucket in engine.export_weights(1 << 30)
            for k, v in bucket.items()}

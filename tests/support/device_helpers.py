"""Shared by the accelerator tests and the ranks they spawn: requests of different prompt lengths
(so the sampler left-pads), generation, a trainer at world size 1, and the log-prob tolerance.

The engine helpers are the package's (`eddyrl/platform_checks/engines.py`, which `eddy platforms
check` runs), so the tests here and the shipped engine checks drive the engines the same way."""

from __future__ import annotations

import torch

from eddyrl.platform_checks.engines import (PROMPTS, collect, greedy, make_trainer,
                                            policy_loss, requests, trained_weights)

__all__ = ["LOSS", "PROMPTS", "collect", "greedy", "logprob_tolerance", "make_trainer",
           "requests", "trained_weights"]

LOSS = policy_loss()

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

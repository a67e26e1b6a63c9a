"""Where the rollout side of the cost model gets its numbers: published vLLM decode benchmarks,
the fit of a serving engine's per-step costs to them, and the pause a weight update makes a
rollout engine take.

Decode (datasheet 3a [C1]: ml-energy/leaderboard, public/data/models/Qwen__Qwen3-*__
{lm-arena-chat,gpqa}.json at 0cd52da; H100 SXM, vLLM): all 43 configurations of Qwen3-8B, 14B
and 32B at TP1 and TP2, batch 8 to 474, chat (~640 output tokens) and GPQA reasoning (~7-8K).
Each gives the median inter-token latency: one engine step. A roofline alone cannot follow
them: at batch 8 it needs 60-78 % of HBM bandwidth, at batch 256 34-50 % (datasheet). What it
lacks is modelled (`cost_model.StepOverheads`): a fixed host cost per step, a cost per running
sequence, a latency per tensor-parallel all-reduce. `fit_step_overheads` fits them, with the HBM
efficiency, by least squares on relative error; the result is `VLLM_STEP_OVERHEADS`.

The mean context of a point (what the KV read depends on) is the prompt plus the mean output
length a running sequence has reached. Sequences are present in the batch in proportion to their
length, so that mean is E[L²] / (2·E[L]) over the published output-length histogram (computed
from each configuration's own histogram: ~600 for chat, ~5,000 for GPQA). The prompt length is
not published: PROMPT_TOKENS = 300 is assumed. Sensitivity: at 100 or 600 the fit gives the same
efficiency (1.0), step_s (3.2 ms), all_reduce_s (11-13 us) and rms (3.7 %), but per_sequence_s
27 or 5 us instead of 18.5 (a decode step of 256 sequences moves by +/-2.5 ms). Holding
prefill_mfu (the matmul term's efficiency) at 0.36 or 0.7 instead of 0.5: rms 4.8 % / 3.6 %.

Weight transfer, checked (not fitted) against verl's on H20 (datasheet 3c [C11]): the runtime's
bytes / (link · comm_efficiency) gives 0.06 s (NVLink) to 1.0 s (NIC) for all 15.2 GB of a 7B
model, measured 0.12 s (4 -> 4 ranks; 0.02 s with checkpoint-engine); 4.1 s over the NIC for
Qwen3-30B-A3B's 61 GB, measured 15.8 s (16 -> 16; 4.4 s with checkpoint-engine). So it matches
an optimised transfer and misses verl's default NCCL path for a MoE (many small tensors) by 4x.

Prefill has no published engine figure here: `Efficiency.prefill_mfu` (0.5) stays an assumption
(this project's H200 kernel-time measurement of 0.5B/1.5B models gave 0.36, a lower bound for
large GEMMs; bench/results/README.md "H200 device check").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from ..errors import ConfigError
from .cost_model import (VLLM_MAX_NUM_BATCHED_TOKENS, CostModel, Efficiency, Measurement,
                         StepOverheads)

PROMPT_TOKENS = 300  # assumed: the benchmark does not publish its prompt lengths

# (model, task, tp, mean batch, E[L²]/(2·E[L]) of its output histogram, median ITL in ms)
_C1_H100_VLLM = (
    ("Qwen3-8B", "chat", 1, 8.0, 610, 8.2), ("Qwen3-8B", "chat", 1, 16.0, 633, 8.9),
    ("Qwen3-8B", "chat", 1, 31.9, 614, 10.6), ("Qwen3-8B", "chat", 1, 63.9, 606, 14.0),
    ("Qwen3-8B", "chat", 1, 95.8, 606, 17.8), ("Qwen3-8B", "chat", 1, 127.8, 593, 20.7),
    ("Qwen3-8B", "chat", 1, 191.7, 635, 26.3), ("Qwen3-8B", "chat", 1, 255.5, 624, 31.4),
    ("Qwen3-8B", "chat", 1, 383.0, 599, 42.7), ("Qwen3-8B", "chat", 1, 474.4, 595, 47.2),
    ("Qwen3-8B", "gpqa", 1, 8.0, 4953, 9.7), ("Qwen3-8B", "gpqa", 1, 16.0, 4854, 11.9),
    ("Qwen3-8B", "gpqa", 1, 32.0, 5252, 16.9), ("Qwen3-8B", "gpqa", 1, 63.3, 5403, 26.6),
    ("Qwen3-8B", "gpqa", 1, 82.0, 5067, 27.9),
    ("Qwen3-14B", "chat", 1, 8.0, 608, 12.5), ("Qwen3-14B", "chat", 1, 16.0, 593, 13.3),
    ("Qwen3-14B", "chat", 1, 31.9, 574, 15.0), ("Qwen3-14B", "chat", 1, 63.8, 596, 18.9),
    ("Qwen3-14B", "chat", 1, 95.9, 616, 23.5), ("Qwen3-14B", "chat", 1, 127.7, 560, 26.2),
    ("Qwen3-14B", "chat", 1, 191.7, 569, 33.4), ("Qwen3-14B", "chat", 1, 253.4, 595, 38.4),
    ("Qwen3-14B", "gpqa", 1, 8.0, 4386, 14.4), ("Qwen3-14B", "gpqa", 1, 16.0, 4994, 17.3),
    ("Qwen3-14B", "gpqa", 1, 32.0, 4380, 21.5), ("Qwen3-14B", "gpqa", 1, 59.0, 4292, 28.1),
    ("Qwen3-32B", "chat", 1, 8.0, 578, 25.2), ("Qwen3-32B", "chat", 1, 16.0, 550, 26.4),
    ("Qwen3-32B", "chat", 1, 29.3, 550, 28.8),
    ("Qwen3-32B", "chat", 2, 8.0, 554, 15.1), ("Qwen3-32B", "chat", 2, 16.0, 554, 16.0),
    ("Qwen3-32B", "chat", 2, 31.9, 570, 17.9), ("Qwen3-32B", "chat", 2, 63.9, 566, 22.4),
    ("Qwen3-32B", "chat", 2, 95.8, 565, 26.1), ("Qwen3-32B", "chat", 2, 127.8, 543, 29.7),
    ("Qwen3-32B", "chat", 2, 191.7, 554, 37.0), ("Qwen3-32B", "chat", 2, 255.6, 564, 44.5),
    ("Qwen3-32B", "chat", 2, 340.2, 549, 54.9),
    ("Qwen3-32B", "gpqa", 2, 8.0, 5030, 16.7), ("Qwen3-32B", "gpqa", 2, 16.0, 4849, 19.3),
    ("Qwen3-32B", "gpqa", 2, 32.0, 5385, 25.3), ("Qwen3-32B", "gpqa", 2, 63.8, 5071, 32.3),
)


def c1_points(prompt_tokens: int = PROMPT_TOKENS) -> tuple[Measurement, ...]:
    """The 43 published decode steps as Measurements (batch rounded to whole sequences)."""
    return tuple(
        Measurement(accelerator="H100", model=model, quantity="decode_step_seconds",
                    arguments={"batch": round(batch), "mean_context": prompt_tokens + reached},
                    seconds=itl_ms / 1e3, tp=tp,
                    source=f"datasheet 3a [C1] {task}")
        for model, task, tp, batch, reached, itl_ms in _C1_H100_VLLM)


VLLM_H100_DECODE_POINTS = c1_points()


@dataclass(frozen=True, kw_only=True, slots=True)
class OverheadFit:
    """Step overheads and HBM efficiency fitted to measured decode steps."""

    overheads: StepOverheads
    efficiency: Efficiency
    points: tuple[Measurement, ...]
    predictions: tuple[float, ...]  # seconds
    residuals: tuple[float, ...]  # predicted / measured - 1

    @property
    def rms(self) -> float:
        return math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals))

    def report(self) -> str:
        o = self.overheads
        lines = [f"decode_bandwidth_efficiency = {self.efficiency.decode_bandwidth_efficiency:.3f}"
                 f", step_s = {o.step_s * 1e3:.2f} ms, per_sequence_s = "
                 f"{o.per_sequence_s * 1e6:.1f} us, all_reduce_s = {o.all_reduce_s * 1e6:.1f} us"
                 f" (prefill_mfu {self.efficiency.prefill_mfu} held; {len(self.points)} points, "
                 f"rms {self.rms:.1%}, worst {max(map(abs, self.residuals)):.1%})"]
        for point, predicted, residual in zip(self.points, self.predictions, self.residuals):
            lines.append(f"  {point.describe()} [{point.source}]: measured "
                         f"{point.seconds * 1e3:.1f} ms, predicted {predicted * 1e3:.1f} ms "
                         f"({residual:+.1%})")
        return "\n".join(lines)


def fit_step_overheads(points: Sequence[Measurement], base: Efficiency | None = None,
                       efficiencies: Sequence[float] | None = None) -> OverheadFit:
    """Fit StepOverheads and decode_bandwidth_efficiency to decode-step measurements: for each
    candidate efficiency (default 0.50 to 1.00 by 0.01) the three overheads enter linearly, so
    least squares on relative error solves them exactly; the candidate with the smallest
    squared error wins. Overheads that come out negative are dropped (held at 0) and the rest
    refitted."""
    points = tuple(points)
    if not points or any(p.quantity != "decode_step_seconds" for p in points):
        raise ConfigError("fit_step_overheads needs decode_step_seconds measurements")
    base = base if base is not None else Efficiency()
    candidates = efficiencies or [round(0.5 + 0.01 * i, 2) for i in range(51)]
    best = None
    for value in candidates:
        efficiency = replace(base, decode_bandwidth_efficiency=value)
        overheads, error = _solve_overheads(points, efficiency)
        if best is None or error < best[0]:
            best = (error, efficiency, overheads)
    _, efficiency, overheads = best
    predictions = tuple(p.predict(efficiency, overheads) for p in points)
    residuals = tuple(pred / p.seconds - 1 for p, pred in zip(points, predictions))
    return OverheadFit(overheads=overheads, efficiency=efficiency, points=points,
                       predictions=predictions, residuals=residuals)


def _solve_overheads(points: tuple[Measurement, ...], efficiency: Efficiency
                     ) -> tuple[StepOverheads, float]:
    """Least squares of (predicted - measured) / measured over the overheads (linear in them);
    the sum of squares."""
    zero = StepOverheads(step_s=0.0, per_sequence_s=0.0, all_reduce_s=0.0)
    rows, targets = [], []
    for point in points:
        cost = CostModel(point.accelerator, point.model, efficiency, tp=point.tp, overheads=zero)
        batch = point.arguments["batch"]
        kernels = cost.decode_step_seconds(batch, point.arguments["mean_context"])
        all_reduces = 2 * cost.model.layers if cost.tp > 1 else 0
        rows.append([1 / point.seconds, batch / point.seconds, all_reduces / point.seconds])
        targets.append(1 - kernels / point.seconds)
    free = [0, 1, 2]
    while True:
        solution = _least_squares([[row[i] for i in free] for row in rows], targets)
        if all(value >= 0 for value in solution) or not free:
            break
        free = [i for i, value in zip(free, solution) if value >= 0]
    values = [0.0, 0.0, 0.0]
    for index, value in zip(free, solution):
        values[index] = value
    error = sum((sum(r * v for r, v in zip(row, values)) - target) ** 2
                for row, target in zip(rows, targets))
    return StepOverheads(step_s=values[0], per_sequence_s=values[1],
                         all_reduce_s=values[2]), error


def _least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """x minimising |rows·x - targets|² by the normal equations (a handful of unknowns)."""
    n = len(rows[0]) if rows else 0
    if n == 0:
        return []
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    rhs = [sum(r[i] * t for r, t in zip(rows, targets)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, n), key=lambda k: abs(normal[k][col]))
        normal[col], normal[pivot] = normal[pivot], normal[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        for k in range(n):
            if k != col and normal[col][col]:
                factor = normal[k][col] / normal[col][col]
                normal[k] = [a - factor * b for a, b in zip(normal[k], normal[col])]
                rhs[k] -= factor * rhs[col]
    return [rhs[i] / normal[i][i] if normal[i][i] else 0.0 for i in range(n)]


# -- the weight update as a pause of a rollout engine ------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class WeightUpdate:
    """What a rollout engine does to take new weights, as Eddy's `vllm` engine does it
    (engines/inference/vllm/engine.py `_load_weights`, `_apply_staged`): it receives the
    weights into a staging copy while it goes on decoding (`receive_s`, the runtime's
    transfer), then between two steps stops (partial rollout: aborts what runs; otherwise the
    old version has drained), copies the staged weights into place (`load_s`), resets its
    prefix cache (`kv_reset_s`: the KV cache stays allocated; nothing is re-allocated), and
    resumes every interrupted sequence, whose context is prefilled again through its token
    budget (`token_budget`, chunked: CostModel.chunked_prefill_seconds). Re-allocating a KV
    cache happens only where an engine slept (colocated roles: vLLM's wake_up, within
    runtime.switch_seconds; vLLM's sleep-mode blog, 2025-10-26, gives 0.1-6 s to wake with the
    weights, the KV share not separated): `kv_reset_s` stays 0 until a figure is measured."""

    load_s: float
    kv_reset_s: float = 0.0
    token_budget: int = VLLM_MAX_NUM_BATCHED_TOKENS

    @property
    def pause_s(self) -> float:
        """The stop before the re-prefill: nothing decodes."""
        return self.load_s + self.kv_reset_s


def staged_load_seconds(cost: CostModel, from_host: bool, host_bandwidth: float) -> float:
    """Copying a rank's staged shard (weights_bytes / tp) into place: from host memory over its
    host link (weights staged through the host, weights.py `stage_from_host`), or from a device
    buffer (the collective channel, transfer.py): read and written once in HBM."""
    shard = cost.weights_bytes / cost.tp
    if from_host:
        return shard / host_bandwidth
    return 2 * shard / (cost.accelerator.hbm_bandwidth
                        * cost.efficiency.decode_bandwidth_efficiency)

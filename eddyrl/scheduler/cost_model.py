"""Roofline estimates of how long the pieces of an RL step take for one model on one accelerator:
a prefill, a decode step, a training step, and moving bytes (weights to rollout, a request's KV
cache to another instance). The adaptive scheduler uses them to split devices between rollout
and training; simulated engines use them as their clock.

Every estimate is work / (peak rate × efficiency): FLOPs over peak FLOP/s for the compute-bound
phases (prefill, training, decode at large batch), bytes over HBM bandwidth for the memory-bound
one (decode at small batch), bytes over a link for transfers. How far real systems fall short of
the peaks depends on kernels, shapes and overlap; the model keeps that shortfall explicit, one
named factor per phase in `Efficiency`, rather than hiding it in the peaks. The defaults come
from the datasheet's calibration points (the project's hardware sheet, section 3), and
`fit_efficiency` refits one factor to measured points, so a calibration is one call that prints
its residuals.

Left out on purpose: kernel launch latency, TP all-reduces inside a forward pass (absorbed by
prefill_mfu and decode_bandwidth_efficiency), overlap of the gradient all-reduce with the
backward pass (the two are added: an upper bound), pipeline parallelism, and the memory capacity
limit on batch (the caller's KV budget decides the batch).

Sans-IO: arithmetic only, no clock.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields, replace
from typing import Mapping, Sequence

from ..errors import ConfigError
from ..validation import check_choice, check_positive, check_range
from .hardware import Accelerator, ModelSpec, lookup_accelerator, lookup_model

MOE_TRAIN_MFU = 0.25  # datasheet 3b: MoE trains at 20-30 % MFU (C6-C8)


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """The fraction of a peak each phase reaches, each in (0, 1]."""

    # Assumed: the datasheet has no prefill point. Forward-only large GEMMs run above training's
    # 35-45 % MFU. Fit it on the first prefill measurements.
    prefill_mfu: float = 0.5
    # Fitted: fit_efficiency(H100_DECODE_POINTS, "decode_bandwidth_efficiency") gives 0.67 with
    # residuals within ±16 %. The datasheet's own estimates: 60-78 % (H100), 63-71 % (A100 bs 1).
    # The same H100 chat runs at batch 64-256 imply 0.34-0.50 (contexts longer than assumed, or
    # per-step overheads a roofline lacks): refit on large-batch points before relying on them.
    decode_bandwidth_efficiency: float = 0.67
    # Datasheet-derived: 3b's suggested default for dense 7-32B models is 35-45 % MFU.
    train_mfu: float = 0.40
    # Datasheet-derived: measured 8-card all_reduce bus bandwidth over the link's figure [A13]:
    # 89 of 400 GB/s on A800 (0.22), 72 of 196 GB/s on 910B (0.37).
    comm_efficiency: float = 0.3

    def __post_init__(self) -> None:
        for factor in fields(self):
            check_range(factor.name, getattr(self, factor.name), 0, 1, lo_open=True)

    @classmethod
    def for_model(cls, model: ModelSpec) -> Efficiency:
        """The defaults, with the lower training MFU of a MoE model."""
        return cls(train_mfu=MOE_TRAIN_MFU) if model.experts else cls()


EFFICIENCY_FACTORS = tuple(factor.name for factor in fields(Efficiency))


class CostModel:
    """Seconds for the phases of an RL step of `model` on `tp` devices of `accelerator`.

    Notation in the formulas: P = model.matmul_params (weights each token is multiplied by, so
    2·P forward FLOPs per token), A = model.attention_flops_per_context_token (4·L·H·d), KV =
    model.kv_bytes_per_token, peak and BW the device's FLOP/s and HBM B/s."""

    def __init__(self, accelerator: Accelerator | str, model: ModelSpec | str,
                 efficiency: Efficiency | None = None, dtype_bytes: int = 2, tp: int = 1) -> None:
        check_range("dtype_bytes", dtype_bytes, 1)
        check_range("tp", tp, 1)
        self.accelerator = (lookup_accelerator(accelerator) if isinstance(accelerator, str)
                            else accelerator)
        self.model = lookup_model(model) if isinstance(model, str) else model
        self.efficiency = (efficiency if efficiency is not None
                           else Efficiency.for_model(self.model))
        self.dtype_bytes = dtype_bytes
        self.tp = tp

    @property
    def weights_bytes(self) -> int:
        """The whole model in `dtype_bytes`: what a full weight sync moves."""
        return self.model.total_params * self.dtype_bytes

    # -- rollout -------------------------------------------------------------------------------

    def prefill_seconds(self, tokens: int, context: int = 0) -> float:
        """Prefill of `tokens` new tokens after `context` cached ones. Each new token attends
        causally to the cache and to the new tokens up to itself:

            FLOPs   = 2·P·n + A·(n·c + n·(n + 1)/2)
            seconds = FLOPs / (peak · prefill_mfu · tp)
        """
        check_range("tokens", tokens, 0)
        check_range("context", context, 0)
        attended = tokens * context + tokens * (tokens + 1) / 2
        flops = (2 * self.model.matmul_params * tokens
                 + self.model.attention_flops_per_context_token * attended)
        return flops / (self.accelerator.peak_flops * self.efficiency.prefill_mfu * self.tp)

    def decode_memory_seconds(self, batch: int, mean_context: float) -> float:
        """The memory term of a decode step: every weight the batch touches and every sequence's
        KV cache is read once. Weights split over tp; the KV cache over at most kv_heads ranks:

            bytes   = model.params_read(b)·dtype/tp + b·ctx·KV/min(tp, kv_heads)
            seconds = bytes / (BW · decode_bandwidth_efficiency)
        """
        check_range("batch", batch, 1)
        check_range("mean_context", mean_context, 0)
        weights = self.model.params_read(batch) * self.dtype_bytes / self.tp
        kv_cache = (batch * mean_context * self.model.kv_bytes_per_token(self.dtype_bytes)
                    / min(self.tp, self.model.kv_heads))
        bandwidth = self.accelerator.hbm_bandwidth * self.efficiency.decode_bandwidth_efficiency
        return (weights + kv_cache) / bandwidth

    def decode_compute_seconds(self, batch: int, mean_context: float) -> float:
        """The compute term of a decode step, at prefill's matmul efficiency:

            seconds = b·(2·P + A·ctx) / (peak · prefill_mfu · tp)

        Attention alone does H/kv_heads FLOPs per KV byte (4 for Qwen3), far below any ridge
        point, so a long context keeps decode memory-bound at any batch."""
        check_range("batch", batch, 1)
        check_range("mean_context", mean_context, 0)
        flops = batch * (2 * self.model.matmul_params
                         + self.model.attention_flops_per_context_token * mean_context)
        return flops / (self.accelerator.peak_flops * self.efficiency.prefill_mfu * self.tp)

    def decode_step_seconds(self, batch: int, mean_context: float) -> float:
        """One decode step of `batch` sequences holding `mean_context` tokens each on average:
        the larger of the memory and the compute term (roofline). With efficiencies of 1 and no
        context, the two meet at batch = dtype_bytes/2 · ridge point for a dense model."""
        return max(self.decode_memory_seconds(batch, mean_context),
                   self.decode_compute_seconds(batch, mean_context))

    def decode_tokens_per_second(self, batch: int, mean_context: float) -> float:
        """Aggregate output tokens/s: one token per sequence per step."""
        return batch / self.decode_step_seconds(batch, mean_context)

    # -- training ------------------------------------------------------------------------------

    def train_step_seconds(self, tokens: int, dp: int = 1, sequence_length: int = 0) -> float:
        """One optimizer step over `tokens` tokens (all dp ranks together) on dp·tp devices,
        sequences of `sequence_length` (0: leave attention out). Backward costs twice forward;
        a causal sequence of length s attends to s/2 tokens on average:

            compute    = 3·(2·P + A·s/2)·tokens / (peak · train_mfu · dp · tp)
            all-reduce = 2·(dp - 1)/dp · weights_bytes/tp / (link · comm_efficiency)

        The ring all-reduce runs over NVLink/HCCS while dp·tp devices fit in one node, else over
        the NIC. Gradients are reduced in dtype_bytes and not overlapped with compute."""
        check_range("tokens", tokens, 0)
        check_range("dp", dp, 1)
        check_range("sequence_length", sequence_length, 0)
        devices = dp * self.tp
        flops_per_token = 3 * (2 * self.model.matmul_params
                               + self.model.attention_flops_per_context_token
                               * sequence_length / 2)
        compute = (flops_per_token * tokens
                   / (self.accelerator.peak_flops * self.efficiency.train_mfu * devices))
        in_node = devices <= self.accelerator.devices_per_node
        link = (self.accelerator.intra_node_bandwidth if in_node
                else self.accelerator.inter_node_bandwidth)
        all_reduce_bytes = 2 * (dp - 1) / dp * self.weights_bytes / self.tp
        return compute + all_reduce_bytes / (link * self.efficiency.comm_efficiency)

    # -- moving state --------------------------------------------------------------------------

    def weight_sync_seconds(self, num_bytes: float, bandwidth: float) -> float:
        """Sending `num_bytes` of weights over a link of `bandwidth` B/s (e.g. weights_bytes / tp
        per rank over accelerator.inter_node_bandwidth): bytes / (bandwidth · comm_efficiency)."""
        check_range("num_bytes", num_bytes, 0)
        check_positive("bandwidth", bandwidth)
        return num_bytes / (bandwidth * self.efficiency.comm_efficiency)

    def kv_transfer_seconds(self, tokens: int, bandwidth: float) -> float:
        """Carrying a request's KV cache of `tokens` tokens to another instance, each of the
        min(tp, kv_heads) ranks holding a shard sending it over its own link of `bandwidth` B/s:

            seconds = tokens·KV / min(tp, kv_heads) / (bandwidth · comm_efficiency)
        """
        check_range("tokens", tokens, 0)
        check_positive("bandwidth", bandwidth)
        shard = tokens * self.model.kv_bytes_per_token(self.dtype_bytes) / min(
            self.tp, self.model.kv_heads)
        return shard / (bandwidth * self.efficiency.comm_efficiency)

    def reprefill_seconds(self, tokens: int) -> float:
        """Rebuilding a moved request's KV cache on its new instance: prefill of its whole
        context (prompt and tokens generated so far) from nothing."""
        return self.prefill_seconds(tokens)

    def kv_transfer_beats_reprefill(self, tokens: int, bandwidth: float) -> bool:
        """Whether a Libra request move should carry the KV cache rather than recompute it.
        Transfer grows linearly with the context, re-prefill faster (attention is quadratic), so
        long contexts favour the transfer and slow links the recompute."""
        return self.kv_transfer_seconds(tokens, bandwidth) < self.reprefill_seconds(tokens)


# -- calibration -------------------------------------------------------------------------------

FITTABLE_QUANTITIES = ("prefill_seconds", "decode_step_seconds", "train_step_seconds",
                       "weight_sync_seconds", "kv_transfer_seconds")
_LOWEST_FACTOR = 1e-3  # the bisection's floor: a factor below this means the model is wrong


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """A measured duration: CostModel(accelerator, model, tp=tp).quantity(**arguments) took
    `seconds`."""

    accelerator: Accelerator | str
    model: ModelSpec | str
    quantity: str
    arguments: Mapping[str, float]
    seconds: float
    tp: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        check_choice("quantity", self.quantity, FITTABLE_QUANTITIES)
        check_positive("seconds", self.seconds)

    @classmethod
    def decode(cls, accelerator: Accelerator | str, model: ModelSpec | str, *, batch: int,
               mean_context: float, tokens_per_second: float, tp: int = 1,
               source: str = "") -> Measurement:
        """A decode point as benchmarks report one: aggregate output tokens/s at a batch size."""
        check_positive("tokens_per_second", tokens_per_second)
        return cls(accelerator=accelerator, model=model, quantity="decode_step_seconds",
                   arguments={"batch": batch, "mean_context": mean_context},
                   seconds=batch / tokens_per_second, tp=tp, source=source)

    def predict(self, efficiency: Efficiency) -> float:
        cost_model = CostModel(self.accelerator, self.model, efficiency, tp=self.tp)
        return getattr(cost_model, self.quantity)(**self.arguments)

    def describe(self) -> str:
        def name(entry: Accelerator | ModelSpec | str) -> str:
            return entry if isinstance(entry, str) else entry.name

        arguments = ", ".join(f"{key}={value}" for key, value in self.arguments.items())
        return (f"{name(self.accelerator)} {name(self.model)} TP{self.tp} "
                f"{self.quantity}({arguments})")


# datasheet 3a [C1]: H100 SXM, vLLM, chat, TP1, batch 8. The benchmark gives no context length;
# 600 assumes a ~300-token prompt plus half of the ~640 output tokens (at batch 8 the KV cache is
# 4-5 % of the bytes read, so the fit hardly depends on it).
H100_DECODE_POINTS = tuple(
    Measurement.decode("H100", model, batch=8, mean_context=600, tokens_per_second=rate,
                       source="datasheet 3a [C1]")
    for model, rate in (("Qwen3-8B", 962), ("Qwen3-14B", 627), ("Qwen3-32B", 312)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """One efficiency factor fitted to measured points."""

    factor: str
    efficiency: Efficiency  # the base efficiency with the fitted factor
    points: tuple[Measurement, ...]
    implied: tuple[float, ...]  # the factor each point alone implies
    predictions: tuple[float, ...]  # seconds, with the fitted factor
    residuals: tuple[float, ...]  # predicted / measured - 1

    def report(self) -> str:
        value = getattr(self.efficiency, self.factor)
        lines = [f"{self.factor} = {value:.3f} (median of {len(self.points)} points)"]
        for point, implied, predicted, residual in zip(self.points, self.implied,
                                                       self.predictions, self.residuals):
            lines.append(f"  {point.describe()}: measured {point.seconds * 1e3:.2f} ms, "
                         f"predicted {predicted * 1e3:.2f} ms ({residual:+.1%}), "
                         f"alone implies {implied:.3f}")
        return "\n".join(lines)


def fit_efficiency(points: Sequence[Measurement], factor: str,
                   base: Efficiency | None = None) -> Fit:
    """Fit one factor of `base` (default: Efficiency()) to measured points: each point implies
    the value at which its prediction equals its measurement (found by bisection, since every
    prediction falls as a factor grows); the fit is their median, robust to one odd point."""
    check_choice("factor", factor, EFFICIENCY_FACTORS)
    if not points:
        raise ConfigError(f"fit_efficiency({factor!r}) needs at least one measured point")
    base = base if base is not None else Efficiency()
    points = tuple(points)
    implied = tuple(_implied_factor(point, factor, base) for point in points)
    fitted = replace(base, **{factor: statistics.median(implied)})
    predictions = tuple(point.predict(fitted) for point in points)
    residuals = tuple(predicted / point.seconds - 1
                      for point, predicted in zip(points, predictions))
    return Fit(factor=factor, efficiency=fitted, points=points, implied=implied,
               residuals=residuals, predictions=predictions)


def _implied_factor(point: Measurement, factor: str, base: Efficiency) -> float:
    """The value of `factor` at which `point`'s prediction equals its measurement, clamped to
    [_LOWEST_FACTOR, 1]: a point faster than the roofline at full efficiency implies 1."""
    def predicted(value: float) -> float:
        return point.predict(replace(base, **{factor: value}))

    low, high = _LOWEST_FACTOR, 1.0
    if predicted(low) == predicted(high):
        raise ConfigError(f"measurement {point.describe()} does not depend on {factor!r} (e.g. "
                          f"a compute-bound decode step); it cannot calibrate it")
    if point.seconds <= predicted(high):
        return high
    if point.seconds >= predicted(low):
        return low
    for _ in range(60):  # halves the log-interval each time: far below any useful precision
        middle = math.sqrt(low * high)
        if predicted(middle) > point.seconds:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)

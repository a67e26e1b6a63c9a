"""Roofline estimates of how long the pieces of an RL step take for one model on one accelerator:
a prefill, a decode step, a training step, and moving bytes (weights to rollout, a request's KV
cache to another instance). The adaptive scheduler uses them to split devices between rollout
and training; simulated engines use them as their clock.

Every estimate is work / (peak rate × efficiency): FLOPs over peak FLOP/s for the compute-bound
phases (prefill, training), bytes over HBM bandwidth for the memory-bound ones (the weights and
KV cache a decode step reads), bytes over a link for transfers. A serving engine's step adds
what no roofline has: a fixed cost per step and a cost per running sequence (scheduling,
sampling, output processing) and, with tensor parallelism, two all-reduces per layer
(`StepOverheads`, fitted to published vLLM decode benchmarks by `rollout_cost.py`). How far
real systems fall short of the peaks depends on kernels, shapes and overlap; the model keeps
that shortfall explicit, one named factor per phase in `Efficiency`, rather than hiding it in
the peaks. The defaults come
from the datasheet's calibration points (the project's hardware sheet, section 3), and
`fit_efficiency` refits one factor to measured points, so a calibration is one call that prints
its residuals.

A training step is built from its parts in `train_cost.py` (per-rank compute, FSDP collectives
over measured links, the optimizer, log-prob passes); `train_step_seconds` is its even split.

Left out on purpose: TP all-reduces inside a prefill (absorbed by prefill_mfu), pipeline
parallelism, and the memory capacity limit on batch (the caller's KV budget decides the batch).

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
from .train_cost import MOE_TRAIN_MFU, TrainCost, TrainLayout, published_train_mfu


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """The fraction of a peak each phase reaches, each in (0, 1]."""

    # Assumed: no published vLLM prefill figure was found (rollout_cost.py). Forward-only large
    # GEMMs run above training's 35-45 % MFU; this project's H200 kernel-time check of 0.5B/1.5B
    # models gave 0.36 (bench/results/README.md), a lower bound for large GEMMs. Also the
    # matmul term of a decode step, where the fit to vLLM's points holds it (rms 3.7 % at 0.5,
    # 4.8 % at 0.36). Fit it on the first prefill measurements.
    prefill_mfu: float = 0.5
    # Fitted with VLLM_STEP_OVERHEADS on 43 vLLM H100 decode points, batch 8-474, TP1/TP2
    # (rollout_cost.fit_step_overheads(VLLM_H100_DECODE_POINTS); datasheet 3a [C1]): the fit
    # reaches the bound 1.0, i.e. the weights and the KV cache stream at the datasheet's HBM
    # rate once the per-step costs are counted apart. (The old roofline-only 0.67 was fitted at
    # batch 8 alone, where 3 ms of step overhead passes for lost bandwidth.)
    decode_bandwidth_efficiency: float = 1.0
    # Datasheet-derived: 3b's suggested default for dense 7-32B models is 35-45 % MFU. A
    # CostModel starts from the figure published for its accelerator (`for_model`).
    train_mfu: float = 0.40
    # Datasheet-derived: measured 8-card all_reduce bus bandwidth over the link's figure [A13]:
    # 89 of 400 GB/s on A800 (0.22), 72 of 196 GB/s on 910B (0.37).
    comm_efficiency: float = 0.3

    def __post_init__(self) -> None:
        for factor in fields(self):
            check_range(factor.name, getattr(self, factor.name), 0, 1, lo_open=True)

    @classmethod
    def for_model(cls, model: ModelSpec, accelerator: Accelerator | None = None) -> Efficiency:
        """The defaults, with the training MFU published for the model's kind (a MoE model
        trains lower) on `accelerator` (scheduler/train_cost.py DENSE_TRAIN_MFU)."""
        if accelerator is None:
            return cls(train_mfu=MOE_TRAIN_MFU) if model.experts else cls()
        return cls(train_mfu=published_train_mfu(accelerator, model))


EFFICIENCY_FACTORS = tuple(factor.name for factor in fields(Efficiency))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOverheads:
    """What one step of a serving engine costs beyond its kernels' roofline, in seconds: host
    work per step (scheduling, input preparation, graph launch, sampling), host and device work
    per running sequence (its sampler row, detokenisation, output processing), and the latency of
    each of the two all-reduces per layer a tensor-parallel forward pass does (tp > 1)."""

    step_s: float
    per_sequence_s: float
    all_reduce_s: float

    def __post_init__(self) -> None:
        for name in ("step_s", "per_sequence_s", "all_reduce_s"):
            check_range(name, getattr(self, name), 0)


# A bare roofline: what kernel-time measurements (bench/device_costs.py) are compared with.
NO_STEP_OVERHEADS = StepOverheads(step_s=0.0, per_sequence_s=0.0, all_reduce_s=0.0)
# Fitted (least squares on relative error, with decode_bandwidth_efficiency) to the 43 H100
# vLLM decode points of datasheet 3a [C1] (ml.energy leaderboard: Qwen3-8B/14B/32B, TP1/TP2,
# batch 8-474, chat and GPQA): rollout_cost.fit_step_overheads(VLLM_H100_DECODE_POINTS) prints
# them and the residuals (rms 3.7 %, worst 11.5 %). Host-side costs: taken to be the same on
# any device of this class (no other engine benchmark with batch sweeps was found).
VLLM_STEP_OVERHEADS = StepOverheads(step_s=3.18e-3, per_sequence_s=18.5e-6,
                                    all_reduce_s=11.9e-6)
# vLLM's token budget per engine step (`max_num_batched_tokens`): running sequences' decode
# tokens first, then prefill chunks in what is left. vllm/engine/arg_utils.py
# `get_batch_defaults`: 8192 for the API server on >= 70 GiB devices other than A100 (16384 for
# the offline LLM class; 2048 / 8192 on smaller devices).
VLLM_MAX_NUM_BATCHED_TOKENS = 8192


class CostModel:
    """Seconds for the phases of an RL step of `model` on `tp` devices of `accelerator`.

    Notation in the formulas: P = model.matmul_params (weights each token is multiplied by, so
    2·P forward FLOPs per token), A = model.attention_flops_per_context_token (4·L·H·d), KV =
    model.kv_bytes_per_token, peak and BW the device's FLOP/s and HBM B/s."""

    def __init__(self, accelerator: Accelerator | str, model: ModelSpec | str,
                 efficiency: Efficiency | None = None, dtype_bytes: int = 2, tp: int = 1,
                 overheads: StepOverheads | None = None) -> None:
        """`overheads`: the engine's per-step costs (default: vLLM's, VLLM_STEP_OVERHEADS)."""
        check_range("dtype_bytes", dtype_bytes, 1)
        check_range("tp", tp, 1)
        self.accelerator = (lookup_accelerator(accelerator) if isinstance(accelerator, str)
                            else accelerator)
        self.model = lookup_model(model) if isinstance(model, str) else model
        self.efficiency = (efficiency if efficiency is not None
                           else Efficiency.for_model(self.model, self.accelerator))
        self.dtype_bytes = dtype_bytes
        self.tp = tp
        self.overheads = overheads if overheads is not None else VLLM_STEP_OVERHEADS

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

    def decode_roofline_seconds(self, batch: int, mean_context: float) -> float:
        """A decode step's kernels alone, as a roofline: the larger of the memory and the compute
        term. With efficiencies of 1 and no context, the two meet at batch = dtype_bytes/2 ·
        ridge point for a dense model."""
        return max(self.decode_memory_seconds(batch, mean_context),
                   self.decode_compute_seconds(batch, mean_context))

    def decode_step_seconds(self, batch: int, mean_context: float) -> float:
        """One engine step decoding `batch` sequences of `mean_context` tokens on average (see
        `engine_step_seconds`)."""
        check_range("batch", batch, 1)
        return self.engine_step_seconds(batch, mean_context)

    def engine_step_seconds(self, batch: int, mean_context: float, prefill_tokens: int = 0,
                            prefill_context: float = 0, prefill_sequences: int = 0) -> float:
        """One step of a continuous-batching engine: `batch` sequences decode a token each
        (`mean_context` tokens of KV on average) while `prefill_tokens` prompt tokens of
        `prefill_sequences` sequences are prefilled in the same forward pass (vLLM's chunked
        prefill), after `prefill_context` cached tokens on average. With n = batch +
        prefill_tokens tokens in the pass and o the engine's StepOverheads:

            weights  = params_read(n)·dtype/tp / (BW · decode_bandwidth_efficiency)
            matmuls  = n·2·P / (peak · prefill_mfu · tp)
            kv       = b·ctx·KV/min(tp, kv_heads) / (BW · decode_bandwidth_efficiency)
            prefill  = A·(p·c_p + p·(p + 1)/2 per sequence) / (peak · prefill_mfu · tp)
            all-red. = 2·layers·(o.all_reduce_s + 2·(tp-1)/tp·n·hidden·dtype
                                 / (NVLink · comm_efficiency))          (tp > 1)
            seconds  = o.step_s + (b + sequences)·o.per_sequence_s + weights + matmuls + kv
                       + prefill + all-reduces

        Weights and matmuls are added, not maxed: at the batches engines run (8-512) a GEMM
        is neither bandwidth- nor compute-bound, and the sum follows vLLM's measured step times
        (rollout_cost.py: rms 3.7 % over 43 points, against 7.4 % for the max). Decode
        attention is its KV read: it does H/kv_heads FLOPs per KV byte, far below any ridge
        point."""
        # the simulator asks this for every decode interval of every engine: a comparison per
        # argument here, the named checks (the same errors) only for a value that fails it
        if not (0 <= batch < math.inf and 0 <= mean_context < math.inf
                and 0 <= prefill_tokens < math.inf and 0 <= prefill_context < math.inf
                and 0 <= prefill_sequences < math.inf):
            check_range("batch", batch, 0)
            check_range("mean_context", mean_context, 0)
            check_range("prefill_tokens", prefill_tokens, 0)
            check_range("prefill_context", prefill_context, 0)
            check_range("prefill_sequences", prefill_sequences, 0)
        tokens = batch + prefill_tokens
        if tokens == 0:
            return 0.0
        model, accelerator, eff = self.model, self.accelerator, self.efficiency
        bandwidth = accelerator.hbm_bandwidth * eff.decode_bandwidth_efficiency
        compute = accelerator.peak_flops * eff.prefill_mfu * self.tp
        weights = model.params_read(tokens) * self.dtype_bytes / self.tp / bandwidth
        matmuls = tokens * 2 * model.matmul_params / compute
        kv = (batch * mean_context * model.kv_bytes_per_token(self.dtype_bytes)
              / min(self.tp, model.kv_heads) / bandwidth)
        per_sequence = max(prefill_sequences, 1 if prefill_tokens else 0)
        chunk = prefill_tokens / per_sequence if per_sequence else 0
        attended = prefill_tokens * prefill_context + per_sequence * chunk * (chunk + 1) / 2
        prefill = model.attention_flops_per_context_token * attended / compute
        overheads = self.overheads
        return (overheads.step_s + (batch + per_sequence) * overheads.per_sequence_s
                + weights + matmuls + kv + prefill + self.tp_all_reduce_seconds(tokens))

    def chunked_prefill_seconds(self, contexts: Sequence[int], budget: int) -> tuple[int, float]:
        """(steps, seconds) to prefill sequences of `contexts` tokens from nothing through an
        engine's token budget of `budget` tokens per step (vLLM's max_num_batched_tokens), in
        order, nothing else in the batch: steps = ceil(sum / budget), each a full engine step
        (fixed costs, weights, all-reduces) over its chunk, and a causal prefill's attention
        FLOPs, A·L·(L + 1)/2 per sequence, whatever the chunking."""
        check_range("budget", budget, 1)
        total = sum(contexts)
        if total == 0:
            return 0, 0.0
        steps = math.ceil(total / budget)
        seconds = sum(self.engine_step_seconds(0, 0, min(budget, total - step * budget))
                      for step in range(steps))
        # engine_step_seconds counted each chunk's attention as a sequence of its own; a
        # sequence's later chunks attend to its earlier ones as well
        chunk_attention = sum(min(budget, total - step * budget) ** 2 for step in range(steps))
        exact = sum(length * length for length in contexts)
        compute = self.accelerator.peak_flops * self.efficiency.prefill_mfu * self.tp
        seconds += self.model.attention_flops_per_context_token * (exact - chunk_attention) / (
            2 * compute)
        # a step holds one sequence per chunk boundary it crosses: N + steps - 1 in all
        seconds += (len([c for c in contexts if c]) - 1) * self.overheads.per_sequence_s
        return steps, seconds

    def tp_all_reduce_seconds(self, tokens: int) -> float:
        """The two all-reduces per layer of a tensor-parallel forward pass over `tokens` tokens
        (attention output and MLP output, hidden·dtype bytes per token each), in the node."""
        if self.tp == 1:
            return 0.0
        ring_bytes = 2 * (self.tp - 1) / self.tp * tokens * self.model.hidden * self.dtype_bytes
        link = self.accelerator.intra_node_bandwidth * self.efficiency.comm_efficiency
        return 2 * self.model.layers * (self.overheads.all_reduce_s + ring_bytes / link)

    def decode_tokens_per_second(self, batch: int, mean_context: float) -> float:
        """Aggregate output tokens/s: one token per sequence per step."""
        return batch / self.decode_step_seconds(batch, mean_context)

    # -- training ------------------------------------------------------------------------------

    def train_step_seconds(self, tokens: int, dp: int = 1, sequence_length: int = 0) -> float:
        """One optimizer step over `tokens` tokens (all dp ranks together) on dp·tp devices,
        tensor parallel over tp, sequences of `sequence_length` (0: leave attention out),
        split evenly over the ranks: scheduler/train_cost.py `TrainCost.uniform_step` (compute
        at train_mfu and the tensor-parallel all-reduces, FSDP's all-gathers and gradient
        reduce-scatter over the measured links, overlapped but for one layer's, and the AdamW
        step). A simulated step over real
        sequence lengths, with its imbalance and log-prob passes: sim/trainer.py."""
        check_range("dp", dp, 1)
        layout = TrainLayout(dp=dp, tp=self.tp, tp_splits_weights=True,
                             param_bytes=self.dtype_bytes)
        cost = TrainCost(self.accelerator, self.model, layout, self.efficiency.train_mfu)
        return cost.uniform_step(tokens, sequence_length).total_s

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
    overheads: StepOverheads | None = None  # the engine's (None: CostModel's default)

    def __post_init__(self) -> None:
        check_choice("quantity", self.quantity, FITTABLE_QUANTITIES)
        check_positive("seconds", self.seconds)

    @classmethod
    def decode(cls, accelerator: Accelerator | str, model: ModelSpec | str, *, batch: int,
               mean_context: float, tokens_per_second: float, tp: int = 1,
               source: str = "", overheads: StepOverheads | None = None) -> Measurement:
        """A decode point as benchmarks report one: aggregate output tokens/s at a batch size."""
        check_positive("tokens_per_second", tokens_per_second)
        return cls(accelerator=accelerator, model=model, quantity="decode_step_seconds",
                   arguments={"batch": batch, "mean_context": mean_context},
                   seconds=batch / tokens_per_second, tp=tp, source=source,
                   overheads=overheads)

    def predict(self, efficiency: Efficiency,
                overheads: StepOverheads | None = None) -> float:
        cost_model = CostModel(self.accelerator, self.model, efficiency, tp=self.tp,
                               overheads=overheads or self.overheads)
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

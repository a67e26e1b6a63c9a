"""Measured prefill, decode and training times of Qwen2.5-shaped models on this machine's
accelerator, next to the cost model's predictions for its datasheet entry, with the efficiency
factors refitted to them (`scheduler/cost_model.py`).

    python bench/device_costs.py [--accelerator auto|H200|...] [--platform auto] [--quick]
                                 [--budget-s 170] [--out bench/results/device_costs.json]

Models are built here from their config.json shapes with random weights (no download), in bf16,
with transformers' default attention (sdpa); one throwaway forward per model precedes its
measurements. Prefill: one forward over (batch, prompt length) with logits at every position,
as the cost model counts the LM head; decode: one token per sequence on a DynamicCache already
holding ~1024 tokens per sequence (rebuilt for every run), the median of several steps;
training: forward, backward and an AdamW step on bf16 weights.

Two times per prefill and decode shape, from separate runs after the same warm-up:
  wall    between two device synchronisations, the median of `repeats` calls;
  kernel  the summed durations of the device work (kernels, copies, sets) that torch.profiler
          records with the platform's device activity, divided by the calls profiled: what
          the call costs with no host overhead (an engine that replays CUDA graphs comes close).
HF eager decode on a fast device is bound by the host (Python, launches), so its wall time
says nothing about the memory-bound step the cost model describes: prefill and decode factors
are fitted on kernel time (the primary fit), training on wall time; the fit on wall time and
the host overhead (wall - kernel) are reported next to it. On the CPU the ops' self CPU time
stands in for kernel time. With no accelerator (or with --quick) a 2-layer Qwen2 on tiny
shapes runs against the CPU's measured entry (`measure_cpu`): that checks the code paths, its
numbers mean little. Writes the JSON after each model, so a run cut short keeps what it
measured. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eddyrl.errors import ConfigError
from eddyrl.hal import Platform, get_platform
from eddyrl.scheduler.cost_model import (NO_STEP_OVERHEADS, CostModel, Efficiency,
                                         Measurement, fit_efficiency)
from eddyrl.scheduler.hardware import (ACCELERATORS, Accelerator, ModelSpec, lookup_accelerator,
                                       measure_cpu, model_from_hf_config)

ROOT = Path(__file__).resolve().parents[1]
DTYPE = torch.bfloat16

# Public config.json values of Qwen/Qwen2.5-0.5B and -1.5B. They are not in hardware.MODELS
# (7B and up), whose _qwen_config also fixes head_dim at 128 where 0.5B has 64.
QWEN2_SHAPES = {
    "Qwen2.5-0.5B": dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "Qwen2.5-1.5B": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "qwen2-2layer": dict(num_hidden_layers=2, hidden_size=128, intermediate_size=384,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}
COMMON_CONFIG = dict(tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6,
                     rms_norm_eps=1e-6)
# Fitted in this order: a decode step's compute term uses prefill_mfu.
FACTOR_OF = {"prefill_seconds": "prefill_mfu", "decode_step_seconds": "decode_bandwidth_efficiency",
             "train_step_seconds": "train_mfu"}
PHASE_OF = {"prefill_seconds": "prefill", "decode_step_seconds": "decode",
            "train_step_seconds": "train"}
# The op through which DynamicCache appends a token: it copies the whole cache every step
# (traffic neither the cost model nor a paged-KV engine has). Its device time is reported, and
# a decode fit on kernel time less it is given beside the primary one.
CACHE_COPY_OP = "aten::cat"
TOP_OPS = 8  # ops kept per point in the JSON, by device time


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    models: tuple[str, ...]
    prefill: tuple[tuple[int, int], ...]  # (batch, prompt length)
    decode_batches: tuple[int, ...]
    decode_context: int  # tokens per sequence already in the cache
    train: tuple[tuple[int, int], ...]  # (batch, sequence length)
    warmup: int
    repeats: int  # timed calls of prefill and training
    decode_steps: int  # timed decode steps
    profiled: int  # profiled calls of prefill and decode (a run of their own)


FULL = Plan(models=("Qwen2.5-0.5B", "Qwen2.5-1.5B"),
            prefill=((1, 512), (1, 2048), (8, 1024), (16, 2048)),
            decode_batches=(1, 8, 32, 128), decode_context=1024, train=((4, 1024), (8, 1024)),
            warmup=3, repeats=5, decode_steps=10, profiled=5)
QUICK = Plan(models=("qwen2-2layer",), prefill=((1, 32), (4, 64)), decode_batches=(1, 4),
             decode_context=64, train=((2, 64),), warmup=1, repeats=2, decode_steps=4,
             profiled=2)


def build_model(name: str, platform: Platform) -> tuple[torch.nn.Module, ModelSpec]:
    """Random bf16 weights, allocated on the device directly (no fp32 copy on the host)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**QWEN2_SHAPES[name], **COMMON_CONFIG)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(platform.device(platform.local_rank())):
            model = Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model, model_from_hf_config(name, config.to_dict())


def timed(platform: Platform, call: Callable[[], object], warmup: int, repeats: int,
          reset: Callable[[], None] | None = None) -> list[float]:
    """Wall seconds of `repeats` calls after `warmup` untimed ones; `reset` (if given) restores
    the calls' state between the two (a decode step grows its cache)."""
    for _ in range(warmup):
        call()
    platform.synchronize()
    if reset is not None:
        reset()
        platform.synchronize()
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        platform.synchronize()
        seconds.append(time.perf_counter() - began)
    return seconds


# ---- kernel time ----------------------------------------------------------------------------

def profiler_activity(device_type: str):
    """The torch.profiler activity that records this device type's work, and whether it is a
    device's. ProfilerActivity names its members after device types (CUDA, XPU, HPU, MTIA), and
    an out-of-tree backend (torch_npu) registers as PrivateUse1 under its own name; an activity
    this build cannot record is passed over. None on a device without one: its host-side op
    times would say nothing about the device. On the CPU, CPU activity (the ops' own time)."""
    from torch.profiler import ProfilerActivity, supported_activities

    cpu = ProfilerActivity.CPU
    if device_type == "cpu":
        return cpu, False
    candidates = [getattr(ProfilerActivity, device_type.upper(), None)]
    privateuse1 = getattr(torch._C, "_get_privateuse1_backend_name", lambda: None)()
    if device_type == privateuse1:
        candidates.append(getattr(ProfilerActivity, "PrivateUse1", None))
    supported = supported_activities()
    for activity in candidates:
        if activity is not None and activity != cpu and activity in supported:
            return activity, True
    return None, True


def _first_attribute(event, *names: str) -> float:
    """The first of `names` the event's class defines (torch renamed *_cuda_time_total to
    *_device_time_total in 2.4 and deprecated the old names), read on the event."""
    for name in names:
        if hasattr(type(event), name):
            return float(getattr(event, name) or 0.0)
    return 0.0


class KernelClock:
    """Per call device time of `repeats` calls, from one torch.profiler session over them."""

    def __init__(self, platform: Platform):
        self.platform = platform
        self.activity, self.on_device = profiler_activity(platform.device_type)
        self.problem: str | None = None  # why kernel time is missing, once it is known
        self.unit = "device events" if self.on_device else "ops"
        if self.activity is None:
            self.problem = (f"torch.profiler cannot record {platform.device_type} activity in "
                            f"this build (supported: {self.supported()})")

    def warm_up(self) -> None:
        """One throwaway session: the first one also initialises the device's tracing library
        (CUPTI and the like), which must neither cost nor drop a measured call."""
        from torch.profiler import ProfilerActivity, profile

        if self.activity is None:
            return
        ones = torch.ones(1024, device=self.platform.device(self.platform.local_rank()))
        try:
            with profile(activities=sorted({ProfilerActivity.CPU, self.activity},
                                           key=lambda a: a.name)) as prof:
                ones.add(1)
                self.platform.synchronize()
            prof.events()
        except Exception as exc:
            self._give_up(f"torch.profiler failed: {type(exc).__name__}: {exc}"[:300])

    def _give_up(self, problem: str) -> None:
        """Records why, and profiles nothing more: the rest is fitted on wall time."""
        self.problem, self.activity = problem, None
        print(f"  # kernel time: {problem}; no more profiling", flush=True)

    @staticmethod
    def supported() -> list[str]:
        from torch.profiler import supported_activities

        return sorted(activity.name for activity in supported_activities())

    def describe(self) -> str:
        if self.activity is None:
            return f"none ({self.problem})"
        if self.on_device:
            return (f"{self.activity.name} activity: summed durations of the device's kernels, "
                    f"copies and sets")
        return "CPU activity: the ops' self CPU time (no device)"

    def measure(self, call: Callable[[], object], repeats: int,
                reset: Callable[[], None] | None = None) -> dict | None:
        """{"seconds": per call, "events": per call, "by_op": {op: seconds per call}} or None."""
        from torch.profiler import ProfilerActivity, profile

        if self.activity is None or repeats < 1:
            return None
        if reset is not None:
            reset()
        activities = sorted({ProfilerActivity.CPU, self.activity}, key=lambda a: a.name)
        self.platform.synchronize()
        try:
            with profile(activities=activities) as prof:
                for _ in range(repeats):
                    call()
                    self.platform.synchronize()
            recorded = prof.events()
        except Exception as exc:  # a profiler that cannot start must not cost the wall time
            return self._give_up(f"torch.profiler failed: {type(exc).__name__}: {exc}"[:300])
        total_us, events, by_op = 0.0, 0, defaultdict(float)
        for event in recorded:
            if (getattr(event, "is_user_annotation", False)  # record_function ranges, and
                    or "annotation" in str(getattr(event, "activity_type", "") or "")):
                continue  # their device-side spans, which overlap the kernels
            on_host = event.device_type == torch.autograd.DeviceType.CPU
            if self.on_device and not on_host:
                # a kernel, copy or set: its duration on the device (what device_time_total
                # returns for these, without the is_async/use_device guards that may zero it)
                total_us += event.time_range.elapsed_us()
                events += 1
            elif self.on_device and not event.is_async:
                # an op: the device time of the kernels it launched itself (not its children's)
                us = _first_attribute(event, "self_device_time_total", "self_cuda_time_total")
                if us > 0:
                    by_op[event.name] += us
            elif not self.on_device and not event.is_async:
                us = _first_attribute(event, "self_cpu_time_total")
                total_us += us
                events += 1
                by_op[event.name] += us
        if total_us <= 0:
            return self._give_up(f"the profiler recorded no {self.activity.name} time "
                                 f"({events} events)")
        top = sorted(by_op.items(), key=lambda item: -item[1])
        return {"seconds": total_us * 1e-6 / repeats, "events": events / repeats,
                "events_are": self.unit,
                "calls": repeats,
                "cache_copy_seconds": by_op.get(CACHE_COPY_OP, 0.0) * 1e-6 / repeats,
                "by_op": {name: us * 1e-6 / repeats for name, us in top[:TOP_OPS]}}


# ---- measurements ---------------------------------------------------------------------------

def measure_prefill(model, spec, platform, plan, clock, batch, length):
    ids = torch.randint(spec.vocab, (batch, length), device=platform.device(platform.local_rank()))

    def call():
        return model(input_ids=ids, use_cache=False)

    with torch.no_grad():
        times = timed(platform, call, plan.warmup, plan.repeats)
        kernel = clock.measure(call, plan.profiled)
    # The cost model's prefill is one sequence; a batch of them costs `batch` times as much.
    return times, kernel, "prefill_seconds", {"tokens": length}, batch


def measure_decode(model, spec, platform, plan, clock, batch):
    from transformers import DynamicCache

    device = platform.device(platform.local_rank())
    state = {}

    def reset():  # random K/V: what a prefill would leave, minus its cost
        state.pop("cache", None)
        cache = DynamicCache()
        for layer in range(spec.layers):
            keys = torch.randn(batch, spec.kv_heads, plan.decode_context, spec.head_dim,
                               dtype=DTYPE, device=device)
            cache.update(keys, torch.randn_like(keys), layer)
        state["cache"] = cache

    ids = torch.randint(spec.vocab, (batch, 1), device=device)

    def call():
        return model(input_ids=ids, past_key_values=state["cache"], use_cache=True)

    with torch.no_grad():
        reset()
        times = timed(platform, call, plan.warmup, plan.decode_steps, reset=reset)
        kernel = clock.measure(call, plan.profiled, reset=reset)
    state.clear()
    # Each run starts from decode_context tokens and grows a token a step; the profiled run's
    # mean context differs by (decode_steps - profiled)/2 tokens, left out.
    mean_context = plan.decode_context + plan.decode_steps / 2
    return times, kernel, "decode_step_seconds", {"batch": batch, "mean_context": mean_context}, 1


def measure_train(model, spec, platform, plan, batch, length, optimizer):
    ids = torch.randint(spec.vocab, (batch, length), device=platform.device(platform.local_rank()))

    def step():
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                 ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = timed(platform, step, plan.warmup, plan.repeats)  # warm-up allocates Adam's state
    return times, None, "train_step_seconds", {"tokens": batch * length,
                                                "sequence_length": length}, 1


@dataclass(kw_only=True, slots=True)
class Point:
    """One shape: its wall-time measurement, and its kernel-time one where there is one."""

    wall: Measurement
    kernel: Measurement | None = None
    less_copy: Measurement | None = None  # decode: kernel time less the cache's copy

    @property
    def primary(self) -> Measurement:  # what the primary fit uses
        return self.kernel or self.wall


def throwaway_forward(model, spec, platform) -> None:
    """First calls pay for library handles, workspaces and kernel choice: not any shape's."""
    ids = torch.randint(spec.vocab, (2, 128), device=platform.device(platform.local_rank()))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    platform.synchronize()


def run_model(name, platform, accelerator, plan, clock, deadline, result) -> list[Point]:
    model, spec = build_model(name, platform)
    counted = sum(p.numel() for p in model.parameters())
    result["models"][name] = {**dataclasses.asdict(spec), "params_counted": counted,
                              "attention": model.config._attn_implementation}
    throwaway_forward(model, spec, platform)
    jobs = [(f"prefill b{b} len{n}", lambda b=b, n=n: measure_prefill(model, spec, platform,
                                                                       plan, clock, b, n))
            for b, n in plan.prefill]
    jobs += [(f"decode b{b} ctx{plan.decode_context}",
              lambda b=b: measure_decode(model, spec, platform, plan, clock, b))
             for b in plan.decode_batches]
    optimizer = None
    for b, n in plan.train:
        def train_job(b=b, n=n):
            nonlocal optimizer
            model.train()
            optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-5)
            return measure_train(model, spec, platform, plan, b, n, optimizer)
        jobs.append((f"train b{b} len{n}", train_job))

    points = []
    for label, job in jobs:
        row = {"model": name, "label": label}
        if time.monotonic() > deadline:
            result["points"].append({**row, "skipped": "time budget spent"})
            continue
        platform.reset_peak_memory()
        try:
            times, kernel, quantity, arguments, per = job()
        except Exception as exc:  # an OOM or a kernel error must not end the run
            result["points"].append({**row, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(f"  {label}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            platform.empty_cache()
            continue
        seconds = statistics.median(times) / per

        def measurement(value: float) -> Measurement:
            # the hf engine's kernels against the bare kernels' model (no serving overheads)
            return Measurement(accelerator=accelerator, model=spec, quantity=quantity,
                               arguments=arguments, seconds=value, source=label,
                               overheads=NO_STEP_OVERHEADS)

        point = Point(wall=measurement(seconds))
        entry = {**row, "quantity": quantity, "arguments": arguments, "per_call_divisor": per,
                 "seconds": seconds, "times": times,
                 "peak_bytes": platform.memory_info().peak_allocated}
        message = f"  {label}: wall {seconds * 1e3:.3f} ms (median of {len(times)})"
        if kernel is not None:
            point.kernel = measurement(kernel["seconds"] / per)
            less = kernel["seconds"] - kernel["cache_copy_seconds"]
            if quantity == "decode_step_seconds" and 0 < less < kernel["seconds"]:
                point.less_copy = measurement(less / per)
            entry.update(kernel_seconds=kernel["seconds"] / per,
                         host_overhead_seconds=seconds - kernel["seconds"] / per,
                         kernel=kernel)
            message += (f", kernel {kernel['seconds'] / per * 1e3:.3f} ms "
                        f"({kernel['events']:.0f} {clock.unit} a call, mean of "
                        f"{kernel['calls']})")
        points.append(point)
        result["points"].append(entry)
        print(message + (f" [per sequence of {per}]" if per > 1 else ""), flush=True)
    del model, optimizer, jobs
    gc.collect()
    platform.empty_cache()
    return points


# ---- fits and report ------------------------------------------------------------------------

def fit_all(points: list[Measurement]) -> tuple[Efficiency, dict, list[str]]:
    efficiency, fits, problems = Efficiency(), {}, []
    for quantity, factor in FACTOR_OF.items():
        chosen = [p for p in points if p.quantity == quantity]
        if not chosen:
            continue
        try:
            fit = fit_efficiency(chosen, factor, base=efficiency)
        except ConfigError as exc:
            problems.append(f"{factor}: {exc}")
            continue
        efficiency, fits[factor] = fit.efficiency, fit
    return efficiency, fits, problems


def decode_line(points: list[Measurement], accelerator: Accelerator) -> dict[str, dict]:
    """Per model, a least-squares line seconds = overhead + bytes / bandwidth over its decode
    points (bytes as the cost model counts them): the roofline has no per-step overhead term,
    and at small batch an eager HF step is launch-bound."""
    out = {}
    for name in sorted({p.model.name for p in points if p.quantity == "decode_step_seconds"}):
        chosen = [p for p in points if p.quantity == "decode_step_seconds" and p.model.name == name]
        if len(chosen) < 2:
            continue
        xs = [CostModel(accelerator, p.model).decode_memory_seconds(**p.arguments)
              * accelerator.hbm_bandwidth * Efficiency().decode_bandwidth_efficiency
              for p in chosen]  # bytes
        ys = [p.seconds for p in chosen]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(
            sum((x - mx) ** 2 for x in xs), 1e-30)
        bandwidth = 1 / slope if slope > 0 else None  # None: time did not grow with bytes
        out[name] = {"overhead_s": my - slope * mx, "bandwidth_Bps": bandwidth,
                     "bandwidth_efficiency": bandwidth and bandwidth / accelerator.hbm_bandwidth}
    return out


def _fit_summary(fits: dict, defaults: Efficiency, kernel_ids: set[int]) -> dict:
    def basis(fit) -> str:  # which time its points are
        on_kernel = sum(id(m) in kernel_ids for m in fit.points)
        return ("kernel time" if on_kernel == len(fit.points) else
                "wall time" if on_kernel == 0 else "kernel time where recorded, else wall time")

    return {factor: {"basis": basis(fit),
                     "default": getattr(defaults, factor),
                     "fitted": getattr(fit.efficiency, factor), "points": len(fit.points),
                     "implied": list(fit.implied), "residuals": list(fit.residuals)}
            for factor, fit in fits.items()}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def report(points: list[Point], result: dict, accelerator: Accelerator) -> None:
    defaults = Efficiency()
    efficiency, fits, problems = fit_all([p.primary for p in points])
    wall_efficiency, wall_fits, wall_problems = fit_all([p.wall for p in points])
    result["fit_problems"] = problems + [f"(wall time) {problem}" for problem in wall_problems]
    implied = {id(m): v for fit in fits.values() for m, v in zip(fit.points, fit.implied)}
    implied_wall = {id(m): v for fit in wall_fits.values()
                    for m, v in zip(fit.points, fit.implied)}

    def factor(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print("\nprefill: per sequence (batch time / batch). Primary fit: prefill and decode on "
          "kernel time, train on wall time; residual = fitted / (kernel, else wall) - 1.")
    print("\n| model | shape | wall ms | kernel ms | host ms | default ms | implied factor | "
          "implied (wall) | fitted ms | residual |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for p in points:
        basis = p.primary
        kernel = p.kernel.seconds if p.kernel else None
        host = p.wall.seconds - kernel if kernel is not None else None
        default, fitted = basis.predict(defaults), basis.predict(efficiency)
        wall_fitted = p.wall.predict(wall_efficiency)
        row = {"model": p.wall.model.name, "label": p.wall.source,
               "quantity": p.wall.quantity, "basis": "kernel" if p.kernel else "wall",
               "wall_s": p.wall.seconds, "kernel_s": kernel, "host_overhead_s": host,
               "kernel_less_cache_copy_s": p.less_copy.seconds if p.less_copy else None,
               "predicted_default_s": default, "implied_factor": implied.get(id(basis)),
               "predicted_fitted_s": fitted, "residual": fitted / basis.seconds - 1,
               "implied_factor_wall": implied_wall.get(id(p.wall)),
               "predicted_wall_fit_s": wall_fitted,
               "residual_wall_fit": wall_fitted / p.wall.seconds - 1}
        rows.append(row)
        print(f"| {row['model']} | {row['label']} | {_ms(p.wall.seconds)} | {_ms(kernel)} | "
              f"{_ms(host)} | {_ms(default)} | {factor(row['implied_factor'])} | "
              f"{factor(row['implied_factor_wall'])} | {_ms(fitted)} | "
              f"{row['residual']:+.1%} |")
    result["comparison"] = rows
    kernel_ids = {id(p.kernel) for p in points if p.kernel}
    result["fits"] = _fit_summary(fits, defaults, kernel_ids)
    result["fits_wall"] = _fit_summary(wall_fits, defaults, set())
    less_copy = [p.less_copy for p in points if p.less_copy]
    if less_copy:
        try:
            fit = fit_efficiency(less_copy, "decode_bandwidth_efficiency", base=efficiency)
            result["fits"]["decode_bandwidth_efficiency"]["less_cache_copy"] = {
                "fitted": fit.efficiency.decode_bandwidth_efficiency,
                "points": len(fit.points), "implied": list(fit.implied),
                "residuals": list(fit.residuals)}
        except ConfigError as exc:
            result["fit_problems"].append(f"(kernel time less {CACHE_COPY_OP}) {exc}")
    print()
    for name, fitted in result["fits"].items():
        wall = result["fits_wall"].get(name)
        spread = max(abs(r) for r in fitted["residuals"])
        line = (f"{name}: default {fitted['default']:.3f} -> fitted on {fitted['basis']} "
                f"{fitted['fitted']:.3f} ({fitted['points']} points, residuals within "
                f"±{spread:.0%})")
        if wall and fitted["basis"] != "wall time":
            line += (f"; on wall time {wall['fitted']:.3f} (residuals within "
                     f"±{max(abs(r) for r in wall['residuals']):.0%})")
        print(line)
        if "less_cache_copy" in fitted:
            extra = fitted["less_cache_copy"]
            print(f"  on kernel time less DynamicCache's {CACHE_COPY_OP} copy: "
                  f"{extra['fitted']:.3f} (residuals within "
                  f"±{max(abs(r) for r in extra['residuals']):.0%})")
    for problem in result["fit_problems"]:
        print(f"fit problem: {problem}")

    lines = {"wall": decode_line([p.wall for p in points], accelerator),
             "kernel": decode_line([p.kernel for p in points if p.kernel], accelerator),
             "kernel_less_cache_copy": decode_line([p.less_copy for p in points
                                                    if p.less_copy], accelerator)}
    result["decode_overhead"] = {}
    for basis, per_model in lines.items():
        for name, line in per_model.items():
            result["decode_overhead"].setdefault(name, {})[basis] = line
            rate = ("no growth with bytes" if line["bandwidth_Bps"] is None else
                    f"{line['bandwidth_Bps'] / 1e9:.0f} GB/s "
                    f"({line['bandwidth_efficiency']:.2f} of HBM)")
            print(f"decode {name} ({basis.replace('_', ' ')}): {line['overhead_s'] * 1e3:.2f} ms "
                  f"a step + bytes at {rate}")
    for name in sorted({row["model"] for row in rows}):
        hosts = [row["host_overhead_s"] for row in rows if row["model"] == name
                 and row["quantity"] == "decode_step_seconds"
                 and row["host_overhead_s"] is not None]
        copies = [(row["label"], row["kernel_s"] - row["kernel_less_cache_copy_s"],
                   row["kernel_s"]) for row in rows if row["model"] == name
                  and row["kernel_less_cache_copy_s"] is not None]
        if hosts:
            print(f"decode {name}: host overhead (wall - kernel) {min(hosts) * 1e3:.2f}.."
                  f"{max(hosts) * 1e3:.2f} ms a step")
        if copies:
            print(f"decode {name}: {CACHE_COPY_OP} (cache copy) of kernel time: " + ", ".join(
                f"{label.split()[1]} {copy * 1e3:.3f}/{total * 1e3:.3f} ms"
                for label, copy, total in copies))


def choose_accelerator(requested: str, platform: Platform, device_name: str) -> Accelerator:
    if platform.device_type == "cpu":
        return measure_cpu(0.5)
    if requested != "auto":
        entry = lookup_accelerator(requested)
        if entry.name.lower() not in device_name.lower():
            print(f"# warning: comparing device {device_name!r} with the {entry.name} entry")
        return entry
    matches = sorted((n for n in ACCELERATORS if n.lower() in device_name.lower()), key=len)
    if not matches:
        raise ConfigError(f"no accelerator entry matches device {device_name!r}; pass "
                          f"--accelerator, one of {', '.join(ACCELERATORS)}")
    return ACCELERATORS[matches[-1]]  # the longest: "H200" rather than "H20"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="auto",
                        help="cost-model entry to compare with (auto: from the device name)")
    parser.add_argument("--platform", default="auto")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (checks the code)")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="stop starting new measurements after this many seconds")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "device_costs.json"))
    args = parser.parse_args()

    started = time.monotonic()
    platform = get_platform(args.platform)
    quick = args.quick or platform.device_type == "cpu"
    if quick and not args.quick:
        print(f"# no accelerator here (platform {platform.name}): running --quick")
    plan = QUICK if quick else FULL
    device_name = platform.properties(0).name
    accelerator = choose_accelerator(args.accelerator, platform, device_name)
    clock = KernelClock(platform)
    clock.warm_up()
    import transformers

    result = {
        "run": {"device": device_name, "platform": platform.describe(),
                "torch": torch.__version__,
                "torch_build": {k: getattr(torch.version, k, None) for k in ("cuda", "hip")},
                "transformers": transformers.__version__, "python": sys.version.split()[0],
                "dtype": str(DTYPE), "quick": quick, "plan": dataclasses.asdict(plan),
                "fp32_matmul_precision": torch.get_float32_matmul_precision(),
                "kernel_time": clock.describe(),
                "profiler_activities_supported": clock.supported()},
        "accelerator": dataclasses.asdict(accelerator), "models": {}, "points": [],
        "notes": ["prefill: per sequence = batch time / batch; logits at every position",
                  "wall: median of timed calls between device synchronisations; kernel: summed "
                  "device durations in a separate profiled run / calls profiled; host overhead "
                  "= wall - kernel",
                  "fits: prefill_mfu and decode_bandwidth_efficiency on kernel time (where "
                  "recorded), train_mfu on wall time; fits_wall: all on wall time",
                  f"decode: DynamicCache grows by torch.cat, so each step also copies the KV "
                  f"cache (traffic the cost model does not count); its device time is the "
                  f"{CACHE_COPY_OP} op's, fitted without it under fits.decode_bandwidth_"
                  f"efficiency.less_cache_copy",
                  "train: bf16 weights and AdamW state (the FSDP engine keeps fp32 masters)"],
    }
    print(f"# bench/device_costs.py on {device_name} ({platform.name}), torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {DTYPE}; cost-model entry "
          f"{accelerator.name} ({accelerator.peak_flops / 1e12:.3g} TFLOP/s, "
          f"{accelerator.hbm_bandwidth / 1e12:.3g} TB/s); kernel time: {clock.describe()}",
          flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    deadline = started + args.budget_s
    points: list[Point] = []
    for name in plan.models:
        print(f"{name}: {QWEN2_SHAPES[name]}", flush=True)
        try:
            points += run_model(name, platform, accelerator, plan, clock, deadline, result)
        except Exception as exc:  # e.g. the model does not build: the next one may
            result.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"  {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if clock.problem:
        result["kernel_time_problem"] = clock.problem
        print(f"# kernel time: {clock.problem}; those points are fitted on wall time")
    report(points, result, accelerator)
    result["run"]["wall_s"] = time.monotonic() - started
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out} in {result['run']['wall_s']:.0f} s")
    failed = [p for p in result["points"] if "error" in p] + result.get("errors", [])
    return 1 if failed or not points else 0


if __name__ == "__main__":
    sys.exit(main())

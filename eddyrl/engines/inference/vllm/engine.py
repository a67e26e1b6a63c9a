"""`vllm`: vLLM's async engine (`AsyncLLM`, v1) behind the inference-engine contract, with the
`hf` engine's semantics (hf.py): per-token log-probs and versions, abort with partial output,
resume, version-tagged requests, delayed or partial-rollout weight updates, progress notes.

How the contract maps onto vLLM:
- A request runs as one vLLM request per *segment*: prompt + its tokens so far as a
  `TokensPrompt`, `max_tokens` = what is left. Tokens stream back as deltas with the sampled
  token's log-prob. `logprobs_mode="processed_logprobs"` makes that log_softmax(logits / T) at
  the token (at T = 1 when greedy), the quantity the trainer recomputes, as long as top-k / top-p
  are off; with them on vLLM renormalises over the kept tokens, so it reports log p + (-log kept
  mass), where `hf` (sampling.py) does not renormalise.
- Weights are staged inside vLLM's worker bucket by bucket while decoding goes on, packed
  through host memory (weights.py) or, with a `collective` channel, received device to
  device by the workers themselves from the trainer's broadcast (transfer.py), and
  applied between two engine steps by vLLM's in-place reload; the prefix cache is then reset,
  its KV being the old weights'. Delayed updates wait for the requests of the hosted version
  to drain, as in `hf`: both ask the version gate (versions.py), here once per generate call,
  whose requests then hold the hosted version until their last result. Partial rollout
  interrupts the running requests
  (abort, which returns every token so far), applies, and resumes each as a new segment: the new
  weights re-prefill prompt + tokens, where `hf` keeps the KV cache the old weights computed.
- Stop strings are matched here, on the streamed tokens, by the same code as in `hf`
  (stop_strings.py), not by vLLM (whose text would start afresh at every segment): the
  trajectory ends at the completing token and the segment is aborted; the token or two vLLM
  sampled after it are dropped (they were never part of the trajectory).
- Memory: `rollout.dtype` is vLLM's `dtype`; the run's longest sequence its `max_model_len`
  (requests past it are refused here, as in `hf`); the KV cache exactly `max_batch_size`
  sequences of it, or vLLM's pool in `rollout.memory_fraction` of the device (api.py
  `kv_cache_args`). One device per worker: no tensor parallelism.
- vLLM's client objects belong to one event loop. The adapter keeps them on a private loop in a
  thread, so callers may use any loop (`asyncio.run` per call, Ray's actor loop) and all engine
  state changes on that one loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from pathlib import Path
from typing import AsyncIterator, Iterable

import torch

from ....hal import WeightBucketSpec, Platform
from . import transfer
from ..base import (InferenceEngine, WeightsNotHeld, check_request, engine_dtype,
                    longest_request)
from ....protocol import EngineStats, GenerationRequest, GenerationResult
from ..routing import VLLM_ROUTING_ENV, check_vllm_routing
from ..stop_strings import watcher
from ..versions import VersionGate, call_version, wait_for_admission
from .api import TokensPrompt, VLLMApi, kv_cache_args, sampling_params
from .loop import LoopThread, Slots
from .trajectory import Trajectory
from .weights import check_complete, check_known, stage_from_host, weight_names
from .weights_back import fetch_held

logger = logging.getLogger(__name__)
_END = object()


class VLLMInferenceEngine(InferenceEngine):
    def __init__(self, model_path: str, platform: Platform, *, seed: int = 0,
                 max_batch_size: int = 256, version: int = 0, partial_rollout: bool = False,
                 dtype: str = "float32", max_model_len: int | None = None,
                 memory_fraction: float = 0.0, kv_cache_bytes: int | None = None,
                 record_routing: bool = False) -> None:
        """`dtype`: the weights' and KV cache's (`rollout.dtype`); `max_model_len`: the
        context vLLM starts with, the run's longest sequence (None: the model's positions);
        `memory_fraction`: the KV cache's sizing (`api.kv_cache_args`); `kv_cache_bytes`
        overrides the exact size. `record_routing` (`rollout.routing_replay`): results carry
        vLLM's routed experts (routing.py), refused where the release has none."""
        self.platform = platform
        self.model_path = model_path
        self.api = VLLMApi.detect(platform)
        itemsize = engine_dtype(platform, dtype).itemsize
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.max_positions = longest_request(int(config.get("max_position_embeddings", 1 << 30)),
                                             max_model_len)
        self._weight_names, self._known_names = weight_names(model_path, config)
        # experts per layer while recording routing (0: not recording)
        self._num_experts = check_vllm_routing(self.api.version, self.api.engine_arg_names,
                                               config, self.api.has_triton) \
            if record_routing else 0
        self.max_batch_size = max_batch_size
        # versions: hosted, staged in the worker, requests admitted on the hosted version
        self._gate = VersionGate(version, partial_rollout=partial_rollout)
        self._sleeping = False
        self._waiting = self._running = self._tokens = 0
        self._busy = 0.0
        self._busy_since: float | None = None
        self._kv_cache_usage = 0.0
        self._aborted: set[str] = set()
        self._interrupted: set[str] = set()  # stopped for a weight switch, to resume
        self._live: dict[str, str] = {}  # request id -> id of its running vLLM segment
        self._segment_ids = itertools.count()
        self._slots = Slots(max_batch_size)
        self._drained = asyncio.Event()  # set whenever no admitted request remains
        self._drained.set()
        self._idle = asyncio.Event()  # set whenever no segment runs in vLLM
        self._idle.set()
        self._switched = asyncio.Event()  # cleared while weights are being switched
        self._switched.set()
        self._switching = asyncio.Lock()
        self._loading = asyncio.Lock()
        args = self.api.engine_args(
            model=model_path, dtype=dtype, seed=seed, max_model_len=self.max_positions,
            max_num_seqs=max_batch_size, logprobs_mode="processed_logprobs",
            enforce_eager=True,  # graph capture / compilation would cost more than it saves here
            distributed_executor_backend="uni",  # one worker, inside the engine-core process
            worker_extension_cls="eddyrl.engines.inference.vllm.transfer.WorkerExtension",
            **({"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else kv_cache_args(
                config, max_batch_size, self.max_positions, itemsize, memory_fraction)),
            enable_sleep_mode=self.api.sleep_supported, disable_log_stats=True,
            **({"enable_return_routed_experts": True} if record_routing else {}))
        self._thread = LoopThread()  # vLLM's client objects are made on the loop they use
        env = {**platform.inference_engine_env(), **(VLLM_ROUTING_ENV if record_routing else {})}
        self._llm = self._thread.run(self.api.start(args, env, self._record_scheduler))
        self._receiving = False  # the workers joined a weight broadcast group

    def _record_scheduler(self, stats) -> None:
        self._kv_cache_usage = float(stats.kv_cache_usage)

    def close(self) -> None:
        """Leave the weight group, stop vLLM's engine-core process and the adapter's thread."""
        async def shutdown() -> None:
            if self._receiving:
                await transfer.close(self._rpc_all)
            self._llm.shutdown()
        self._thread.run(shutdown())
        self._thread.stop()

    @property
    def version(self) -> int:
        return self._gate.hosted

    @property
    def partial_rollout(self) -> bool:
        return self._gate.partial_rollout

    # ---- generation (caller's loop) ---------------------------------------------------------
    async def generate(self, requests: list[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()

        def emit(item) -> None:
            if not loop.is_closed():  # a caller gone with its loop hears nothing more
                loop.call_soon_threadsafe(results.put_nowait, item)

        job = self._thread.submit(self._generate(list(requests), emit))
        job.add_done_callback(lambda _: emit(_END))  # after every result it emitted
        try:
            while (item := await results.get()) is not _END:
                yield item
            job.result()  # re-raise the engine side's error
        finally:
            job.cancel()  # a caller that stops listening leaves no request running

    # ---- generation (adapter's loop) --------------------------------------------------------
    async def _generate(self, requests: list[GenerationRequest], emit) -> None:
        if not requests:
            return
        for request in requests:
            check_request(request, self.max_positions)
        if self._sleeping:
            raise RuntimeError("generate called on a sleeping engine; call wake() first")
        self._waiting += len(requests)
        try:
            hosted = await self._switch_for(requests)
        except BaseException:
            self._waiting -= len(requests)
            raise
        if not hosted:  # its weights are gone: the caller places it elsewhere
            self._waiting -= len(requests)
            for request in requests:
                emit(Trajectory(request).result("refused"))
            return
        self._gate.started(len(requests))  # admitted with no await since the version check
        self._drained.clear()
        tasks = [asyncio.ensure_future(self._run(request, emit)) for request in requests]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _switch_for(self, requests: list[GenerationRequest]) -> bool:
        """As `hf`: ask the gate until the call may start, on the hosted version or, once the
        running requests drained, on the staged weights; False: refused (its version is gone).
        Returns with no await after its last check, so the caller admits on that version."""
        return await wait_for_admission(  # never while weights are being switched
            self._gate, call_version(r.version for r in requests),
            f"request {requests[0].request_id}", apply_staged=self._apply_staged,
            drained=self._drained, not_switching=self._switched,
            resumed=any(r.resume_ids for r in requests))

    async def _run(self, request: GenerationRequest, emit) -> None:
        trajectory = Trajectory(request, stops=watcher(request.sampling.stop_strings,
                                                        self.model_path))
        rid = request.request_id
        started = False
        try:
            reason = "abort"  # aborted while waiting for a slot
            if await self._slots.acquire(lambda: rid in self._aborted):
                started = True
                self._waiting -= 1
                self._running += 1
                reason = await self._decode(trajectory, emit)
            emit(trajectory.result(reason))
        finally:
            if started:
                self._running -= 1
                await self._slots.release()
            else:
                self._waiting -= 1
            self._aborted.discard(rid)
            self._interrupted.discard(rid)
            self._gate.finished()
            if self._gate.running == 0:
                self._drained.set()  # staged weights wait for a request that needs them

    async def _decode(self, trajectory: Trajectory, emit) -> str:
        rid = trajectory.request.request_id
        while True:
            await self._switched.wait()  # a weight switch in progress: resume on the new weights
            if rid in self._aborted:
                return "abort"
            reason = await self._segment(trajectory, emit)
            if reason != "abort" or rid not in self._interrupted:
                return reason
            self._interrupted.discard(rid)

    async def _segment(self, trajectory: Trajectory, emit) -> str:
        """One vLLM request from the trajectory's tokens so far; returns its finish reason."""
        request, rid = trajectory.request, trajectory.request.request_id
        vid = f"{rid}#{next(self._segment_ids)}"
        version = self._gate.token_version()  # constant: weights switch when no segment runs
        self._enter(rid, vid)
        reason, stopping, at_stop = None, False, False
        try:
            prompt = TokensPrompt(prompt_token_ids=request.prompt_ids + trajectory.tokens)
            params = sampling_params(request.sampling,
                                     request.sampling.max_new_tokens - len(trajectory.tokens))
            async for out in self._llm.generate(prompt, params, vid):
                if out.finished and self._num_experts:  # vLLM sends them at the end only
                    trajectory.keep_experts(out.outputs[0].routed_experts, self._num_experts)
                if at_stop:
                    continue  # vLLM's tokens after a stop string: dropped, until its abort
                completion = out.outputs[0]
                before = len(trajectory.tokens)
                at_stop = trajectory.extend(completion.token_ids, completion.logprobs, version)
                now = len(trajectory.tokens)
                self._tokens += now - before
                ended = out.finished or at_stop
                for length in sorted(request.report_at):  # passed, and not where it ended
                    if before < length <= now and (length < now or not ended):
                        emit(trajectory.result("progress", length))
                if at_stop:
                    reason = "stop"
                    if not out.finished:
                        await self._llm.abort(vid)
                elif out.finished:
                    reason = completion.finish_reason
                elif not stopping and (rid in self._aborted or rid in self._interrupted):
                    stopping = True  # asked to stop before vLLM knew this request id
                    await self._llm.abort(vid)
        finally:
            self._leave(rid)
        if reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"vLLM ended request {rid} with finish reason {reason!r}")
        return reason

    def _enter(self, rid: str, vid: str) -> None:
        if not self._live:
            self._busy_since = time.perf_counter()
            self._idle.clear()
        self._live[rid] = vid

    def _leave(self, rid: str) -> None:
        del self._live[rid]
        if not self._live:
            self._busy += time.perf_counter() - self._busy_since
            self._busy_since = None
            self._kv_cache_usage = 0.0  # vLLM reports per step; no step runs now
            self._idle.set()

    async def abort(self, request_ids: Iterable[str]) -> None:
        await self._thread.call(self._abort(list(request_ids)))

    async def _abort(self, request_ids: list[str]) -> None:
        self._aborted.update(request_ids)
        live = [self._live[rid] for rid in request_ids if rid in self._live]
        if live:
            await self._llm.abort(live)  # their streams end with every token so far
        await self._slots.notify()  # waiting ones leave

    # ---- weights and memory ----------------------------------------------------------------
    async def load_weights(self, version: int, buckets: Iterable[dict[str, torch.Tensor]],
                           *, hold: bool = False) -> None:
        """Stage the buckets in vLLM's worker while decoding goes on, then apply them now if
        nothing of the hosted version runs (or with partial rollout), else once it drained."""
        async def stage() -> set[str]:
            return await stage_from_host(self._rpc, buckets, self._known_names)
        await self._thread.call(self._load_weights(version, stage, hold))

    def weight_ranks(self) -> int:
        """One receiving rank per vLLM worker (tensor- and pipeline-parallel ranks)."""
        return int(self._llm.vllm_config.parallel_config.world_size)

    def connect_weight_channel(self, rendezvous: str, rank_offset: int, world_size: int,
                               timeout_s: float = 600.0, address: str | None = None) -> None:
        self._thread.run(transfer.connect(self._rpc_all, self.platform.name, rendezvous,
                                          rank_offset, world_size, timeout_s, address))
        self._receiving = True

    async def receive_weights(self, version: int, specs: list[WeightBucketSpec], *,
                              hold: bool = False) -> None:
        """As `load_weights`, the workers taking each bucket off the trainer's broadcast into
        device buffers (transfer.py). An update with wrong names is received whole (the
        broadcast needs every rank) and then refused."""
        if not self._receiving:
            raise RuntimeError("receive_weights before connect_weight_channel")

        async def stage() -> set[str]:
            names = await transfer.receive(self._rpc_all, specs)
            check_known(names, self._known_names)
            return names
        await self._thread.call(self._load_weights(version, stage, hold))

    async def _load_weights(self, version: int, stage, hold: bool = False) -> None:
        """`stage()` fills the worker's incoming copy and returns the names it brought; a
        complete update becomes the staged one (a failed one leaves that as it was)."""
        async with self._loading:
            await self._rpc_all("eddy_begin_staging")
            try:
                check_complete(version, await stage(), self._weight_names)
            except BaseException:
                await self._rpc_all("eddy_drop_incoming")  # what was staged before stays
                raise
            async with self._switching:  # not while a switch applies the previous copy
                await self._rpc_all("eddy_commit_staged")
                self._gate.stage(version, hold=hold)
        if self._gate.due():
            await self._apply_staged()

    async def _apply_staged(self) -> None:
        """Swap the staged weights in between two engine steps. Running segments (only with
        partial rollout) are interrupted first and resume on the new weights."""
        async with self._switching:
            if not self._gate.can_switch():
                return  # applied meanwhile, or requests joined the hosted version first
            self._switched.clear()
            try:
                if self._live:
                    self._interrupted.update(self._live)
                    await self._llm.abort(list(self._live.values()))
                    await self._idle.wait()
                await self._rpc_all("eddy_apply_staged")
                if not await self._llm.reset_prefix_cache():  # its KV came from the old weights
                    logger.warning("vLLM kept its prefix cache after a weight update: cached "
                                   "prompts may reuse the old weights' KV")
                self._gate.apply()
            finally:
                self._switched.set()

    async def held_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The staged update over the hosted weights (its version, else the hosted one), read
        back from the worker under the trainer's names (weights_back.py), taken while no
        update commits or applies."""
        return await self._thread.call(self._held_weights())

    async def _held_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        if self._sleeping and self.api.sleep_supported:
            raise WeightsNotHeld("the vllm engine is asleep (its weights are off the "
                                 "device): wake it first")
        async with self._switching:
            gate = self._gate
            version = gate.hosted if gate.staged is None else gate.staged
            return version, await fetch_held(self._rpc, self._known_names)

    async def _rpc_all(self, method: str, *args) -> list:
        return await self._llm.collective_rpc(method, args=args)  # one result per worker

    async def _rpc(self, method: str, *args):
        return (await self._rpc_all(method, *args))[0]

    async def sleep(self) -> None:
        await self._thread.call(self._sleep())

    async def _sleep(self) -> None:
        """Where vLLM's platform has no sleep mode (its CPU backend) nothing is freed: the
        engine only refuses to generate until `wake`, as `hf` does on the CPU."""
        if self.api.sleep_supported:
            await self._llm.sleep(level=1)  # weights to host memory, KV cache dropped
        self._sleeping = True
        self.platform.release_memory()

    async def wake(self) -> None:
        await self._thread.call(self._wake())

    async def _wake(self) -> None:
        self.platform.restore_memory()
        if self.api.sleep_supported:
            await self._llm.wake_up()
        self._sleeping = False

    def configure(self, *, max_batch_size: int | None = None,
                  partial_rollout: bool | None = None) -> None:
        """From the next request on; vLLM's own batch cap (`max_num_seqs`, fixed at start) still
        bounds it, so a larger size than the engine started with queues inside vLLM. Returns
        once done: weights that switching partial rollout on applies are in place."""
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size = {max_batch_size}: must be >= 1")
        self._thread.run(self._configure(max_batch_size, partial_rollout))

    async def _configure(self, max_batch_size: int | None, partial_rollout: bool | None) -> None:
        if max_batch_size is not None:
            self.max_batch_size = max_batch_size
            await self._slots.resize(max_batch_size)
        if partial_rollout is not None:
            self._gate.partial_rollout = partial_rollout
            if self._gate.due():
                await self._apply_staged()  # partial rollout takes new weights at once

    def stats(self) -> EngineStats:
        since = self._busy_since
        busy = self._busy + (time.perf_counter() - since if since is not None else 0.0)
        return EngineStats(running=self._running, waiting=self._waiting,
                           version=self._gate.hosted, staged_version=self._gate.staged,
                           tokens_generated=self._tokens,
                           busy_seconds=busy, kv_cache_usage=self._kv_cache_usage,
                           sleeping=self._sleeping)


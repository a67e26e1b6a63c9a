"""`hf`: a transformers model with a KV cache, decoding a batch of requests step by step.

Each `generate` call decodes its requests as one batch, left-padded. The samples of one prompt
share its prefill; keys and values go into per-layer buffers that grow in doublings
(kv_cache.py); decode steps of Llama-family models run op by op without transformers'
per-module Python (lean_decode.py); finished rows leave the batch (and the KV cache) once they
are a quarter of it, so one long trajectory does not keep the short ones' compute alive.
tests/integration/engines/test_hf_decode.py pins this path to a plain forward. Steps run in a worker
thread, so `abort`, `stats` and weight loads are served while a batch decodes.

Weight updates are delayed (AsyncFlow): `load_weights` first receives the new weights into a
staging copy (kept where the weight channel delivered them) while decoding goes on; they are
applied at once if nothing runs, else when a request that needs them arrives and the running
ones have drained. Until then the engine keeps hosting its version, so requests of that
version (migrated, or filling free slots) can still join. Every token of a trajectory comes
from one version (DORA's C1).
With `partial_rollout=True` they are applied at the next decode step instead: running
trajectories continue on the new version, and every token records the version that sampled it.
Those rules are the version gate's (versions.py); each chunk of a call asks it to start.
An update may also be LoRA's low-rank factors alone (`train.lora`, engines/low_rank.py): the
engine merges them onto the weights it had before the first such update.

With `record_routing` (`rollout.routing_replay`, a MoE model) every forward's router choices
are kept per row (routing.py): the prefill's for the prompt and resumed tokens (left padding
dropped; resumed tokens keep the experts they came with), each decode step's for the token it
fed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable

import torch
from transformers import AutoModelForCausalLM

from ...hal import Platform
from .base import (InferenceEngine, OutputSoFar, WeightsNotHeld, check_request, engine_dtype,
                   longest_request)
from ...models.config import weights_kwargs
from ...protocol import EngineStats, GenerationRequest, GenerationResult, RoutedExperts
from .kv_cache import buffered_cache
from .. import low_rank
from .lean_decode import LeanDecoder
from .routing import ExpertRecorder, as_routed, input_rows, with_carried
from .sampling import sample
from .stop_strings import watcher
from .versions import VersionGate, call_version, wait_for_admission


# Finished rows stay in the KV cache's batch until they are more than this share of it.
DEAD_ROWS_BEFORE_COMPACTION = 0.25


@dataclass
class _Row(OutputSoFar):
    # routing replay: the id array type, or None when not recording; then the experts of
    # each input token, in chunks as the forward passes ran ([n, layers, top_k] each)
    typecode: str | None = None
    experts: list[torch.Tensor] = field(default_factory=list)

    def result(self, reason: str) -> GenerationResult:
        return GenerationResult(self.request.request_id, list(self.request.prompt_ids),
                                self.tokens, self.logprobs, self.versions, reason,
                                routed_experts=self._routed())

    def progress(self) -> GenerationResult:
        """A snapshot: the row keeps growing after it is reported."""
        return GenerationResult(self.request.request_id, list(self.request.prompt_ids),
                                list(self.tokens), list(self.logprobs), list(self.versions),
                                "progress", routed_experts=self._routed())

    def _routed(self) -> RoutedExperts | None:
        """The experts of every input token so far: the sampled last token has not been fed
        (routing.py), so prompt + tokens - 1 rows. A row that never ran keeps what it came
        with."""
        if self.typecode is None or not self.experts:
            return self.request.resume_experts
        rows = input_rows(len(self.request.prompt_ids), len(self.tokens))
        return as_routed(torch.cat(self.experts)[:rows], self.typecode)


class HFInferenceEngine(InferenceEngine):
    def __init__(self, model_path: str, platform: Platform, *, seed: int = 0,
                 max_batch_size: int = 256, version: int = 0,
                 partial_rollout: bool = False, dtype: str = "float32",
                 max_model_len: int | None = None, memory_fraction: float = 0.0,
                 record_routing: bool = False) -> None:
        """`dtype`: the weights' and KV cache's (`rollout.dtype`); `max_model_len`: the
        longest request taken (the run's longest sequence); `memory_fraction` must be 0: the
        KV cache grows with the batch, there is no pool to size. `record_routing`
        (`rollout.routing_replay`): each result carries the experts its tokens were routed
        to (routing.py); refused on a model without expert routers."""
        if memory_fraction:
            raise ValueError(f"memory_fraction = {memory_fraction}: the hf engine's KV cache "
                             "grows with the batch; only 0 is allowed")
        self.platform = platform
        self.model_path = model_path
        self.device = platform.device(platform.local_rank())
        model = AutoModelForCausalLM.from_pretrained(model_path,
                                                     dtype=engine_dtype(platform, dtype),
                                                     **weights_kwargs(model_path))
        self.model = platform.apply_model_patches(model).to(self.device).eval()
        self._recorder = ExpertRecorder(self.model) if record_routing else None
        # decode steps without transformers' per-module Python, where it reproduces them (and
        # not while recording routing: its steps bypass the routers' hooks)
        lean = LeanDecoder.for_model(self.model) if self._recorder is None else None
        self._lean = lean if lean is not None and lean.matches_transformers(self.device) \
            else None
        self.max_positions = longest_request(
            int(getattr(self.model.config, "max_position_embeddings", 1 << 30)), max_model_len)
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self._gate = VersionGate(version, partial_rollout=partial_rollout)
        self._lock = threading.Lock()  # one decode step or one weight bucket at a time
        self._aborted: set[str] = set()
        self._waiting = 0
        self._tokens = 0
        self._busy = 0.0
        self._sleeping = False
        self._staged: dict[str, torch.Tensor] | None = None  # weights of `_gate.staged`
        # LoRA updates (engines/low_rank.py): each adapted weight as it was before the first
        # one, on the weights' device; every version merges onto these, never onto the last
        self._base: dict[str, torch.Tensor] = {}
        self._drained = asyncio.Event()  # set whenever no request is running
        self._drained.set()

    @property
    def version(self) -> int:
        return self._gate.hosted

    @property
    def partial_rollout(self) -> bool:
        return self._gate.partial_rollout

    # ---- generation ---------------------------------------------------------------------
    async def generate(self, requests: list[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        for request in requests:
            check_request(request, self.max_positions)
        pending = list(requests)
        self._waiting += len(pending)
        try:
            while pending:
                chunk, pending = pending[:self.max_batch_size], pending[self.max_batch_size:]
                self._waiting -= len(chunk)
                for request in [r for r in chunk if r.request_id in self._aborted]:
                    self._aborted.discard(request.request_id)  # aborted before it started
                    chunk.remove(request)
                    yield _Row(request).result("abort")
                if not chunk:
                    continue  # every request of it was aborted before it started
                async for result in self._decode(chunk):
                    yield result
        finally:
            self._waiting -= len(pending)

    async def _decode(self, chunk: list[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        if self._sleeping:
            raise RuntimeError("generate called on a sleeping engine; call wake() first")
        if not await self._switch_for(chunk):
            for request in chunk:  # its weights are gone: the caller places it elsewhere
                yield _Row(request).result("refused")
            return
        typecode = self._recorder.typecode if self._recorder is not None else None
        rows = [_Row(r, stops=watcher(r.sampling.stop_strings, self.model_path),
                     typecode=typecode) for r in chunk]
        self._gate.started(len(rows))  # no await since the gate admitted them
        self._drained.clear()
        try:
            state = await asyncio.to_thread(self._prefill, rows)
            while rows:
                for result in await asyncio.to_thread(self._step, rows, state):
                    self._gate.finished(int(result.final))
                    yield result
        finally:
            self._gate.finished(len(rows))
            for row in rows:
                self._aborted.discard(row.request.request_id)
            if self._gate.running == 0:
                self._drained.set()  # staged weights wait for a request that needs them

    async def _switch_for(self, chunk: list[GenerationRequest]) -> bool:
        """Ask the gate until the chunk may start: at once on the hosted version, or once the
        running requests drained and the staged weights are applied. False: refused, its
        version is gone (C1 forbids running the requests on others)."""
        return await wait_for_admission(
            self._gate, call_version(r.version for r in chunk), f"request {chunk[0].request_id}",
            apply_staged=self._apply_staged, drained=self._drained,
            resumed=any(r.resume_ids for r in chunk))

    def _prefill(self, rows: list[_Row]) -> dict:
        """Left-pad each distinct prompt (+ resumed tokens) once, run the first forward pass on
        those and give every row its sequence's cache: the n samples of a prompt share one
        prefill (measured on the default run: prefilling each prompt n times was a third of
        its generation time)."""
        sequences = [row.request.prompt_ids + row.tokens for row in rows]
        distinct: dict[tuple[int, ...], int] = {}
        owner = [distinct.setdefault(tuple(seq), len(distinct)) for seq in sequences]
        width = max(map(len, distinct))
        ids = torch.zeros(len(distinct), width, dtype=torch.long)
        mask = torch.zeros(len(distinct), width, dtype=torch.long)
        for i, seq in enumerate(distinct):
            ids[i, width - len(seq):] = torch.tensor(seq)
            mask[i, width - len(seq):] = 1
        capacity = width + max(row.request.sampling.max_new_tokens - len(row.tokens)
                               for row in rows)
        state = {"mask": mask.to(self.device), "cache": buffered_cache(capacity)}
        logits = self._forward(ids.to(self.device), state)
        if self._recorder is not None:  # each row's sequence, left padding dropped
            for row, o, seq in zip(rows, owner, sequences):
                row.experts.append(with_carried(state["routed"][o, width - len(seq):],
                                                row.request.resume_experts))
        if len(distinct) < len(rows):
            index = torch.tensor(owner, device=self.device)
            state["cache"].batch_select_indices(index)
            state["mask"], logits = state["mask"][index], logits[index]
        state["logits"] = logits  # of the rows still decoding, in `rows` order
        state["slots"] = list(range(len(rows)))  # each such row's place in the cache's batch
        return state

    def _forward(self, ids: torch.Tensor, state: dict) -> torch.Tensor:
        mask = state["mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        with self._lock, torch.no_grad(), self.platform.profile_range("eddy.rollout.forward"):
            started = time.perf_counter()
            if self._lean is not None and ids.shape[1] == 1:
                logits = self._lean(ids, positions, mask, state["cache"])
            else:
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                    past_key_values=state["cache"], use_cache=True,
                                    logits_to_keep=1).logits[:, -1, :]
            state["version"] = self._gate.token_version()  # the weights these logits came from
            if self._recorder is not None:
                state["routed"] = self._recorder.take(*ids.shape)
            self._busy += time.perf_counter() - started
        return logits

    def _step(self, rows: list[_Row], state: dict) -> list[GenerationResult]:
        """Sample one token for every row, take finished rows out of `rows` and the KV cache,
        and run the next forward pass for the rest. Returns the finished rows' results and
        progress notes of the rows that reached one of their `report_at` lengths."""
        version = state["version"]
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):  # rows with the same sampling settings sample together
            s = row.request.sampling
            groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
        next_tokens = torch.empty(len(rows), dtype=torch.long, device=self.device)
        for (temperature, top_k, top_p), index in groups.items():
            idx = torch.tensor(index, device=self.device)
            tokens, logprobs = sample(state["logits"][idx], temperature=temperature, top_k=top_k,
                                      top_p=top_p, generator=self.generator)
            next_tokens[idx] = tokens
            for j, token, logprob in zip(index, tokens.tolist(), logprobs.tolist()):
                rows[j].tokens.append(token)
                rows[j].logprobs.append(logprob)
                rows[j].versions.append(version)
        self._tokens += len(rows)
        reasons = [self._finish_reason(row) for row in rows]
        finished = [row.result(reason) for row, reason in zip(rows, reasons) if reason]
        keep = [i for i, reason in enumerate(reasons) if reason is None]
        notes = [rows[i].progress() for i in keep
                 if len(rows[i].tokens) in rows[i].request.report_at]
        rows[:] = [rows[i] for i in keep]
        for result in finished:
            self._aborted.discard(result.request_id)
        if keep:
            self._next_forward(state, [state["slots"][i] for i in keep], next_tokens[keep])
            if self._recorder is not None:  # the token each live row just fed
                for row, slot in zip(rows, state["slots"]):
                    row.experts.append(state["routed"][slot])
        return notes + finished

    def _next_forward(self, state: dict, live: list[int], tokens: torch.Tensor) -> None:
        """Run the forward pass of the live rows' sampled `tokens` (their cache rows `live`).
        Finished rows leave the cache's batch once they are a quarter of it; until then they
        ride along on a placeholder token, cheaper than copying the cache at every finish."""
        batch = state["mask"].shape[0]
        if batch - len(live) > batch * DEAD_ROWS_BEFORE_COMPACTION:
            index = torch.tensor(live, device=self.device)
            state["cache"].batch_select_indices(index)
            state["mask"] = state["mask"][index]
            live, ids = list(range(len(live))), tokens
        elif len(live) < batch:
            ids = tokens.new_zeros(batch)
            ids[live] = tokens
        else:
            ids = tokens
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(len(ids), 1)], -1)
        logits = self._forward(ids[:, None], state)
        state["logits"] = logits if len(live) == len(logits) else logits[live]
        state["slots"] = live

    def _finish_reason(self, row: _Row) -> str | None:
        s = row.request.sampling
        if row.tokens[-1] in s.stop_token_ids or (row.stops and row.stops.push(row.tokens[-1])):
            return "stop"
        if len(row.tokens) >= s.max_new_tokens:
            return "length"  # complete: an abort that arrives now changes nothing
        if row.request.request_id in self._aborted:
            return "abort"
        return None

    async def abort(self, request_ids: Iterable[str]) -> None:
        self._aborted.update(request_ids)

    # ---- weights and memory ----------------------------------------------------------------
    async def load_weights(self, version: int, buckets: Iterable[dict[str, torch.Tensor]],
                           *, hold: bool = False) -> None:
        """Receive and check the new weights off the critical path, then apply them now if
        nothing runs and nothing is held (or with partial rollout), else when the running
        batches have drained and a newer request arrives."""
        staged = await asyncio.to_thread(self._stage, version, buckets)
        self._staged = staged
        self._gate.stage(version, hold=hold)
        if self._gate.due():
            # On the event loop, not in a thread: a request checked against the old version
            # must not start while the new weights are being copied in.
            self._apply_staged()

    def _stage(self, version: int, buckets: Iterable[dict[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
        targets = self.model.state_dict(keep_vars=True)
        staged: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            unknown = [name for name in bucket
                       if (low_rank.target_of(name) or name) not in targets]
            if unknown:
                raise KeyError(f"weights {unknown[:3]} do not belong to this model")
            # Kept as delivered: moving device tensors back to the host here would only add a
            # round trip before `_apply_staged` copies them onto the device again.
            staged.update({name: tensor.detach() for name, tensor in bucket.items()})
        if low_rank.targets(staged):  # a LoRA update: what it does not name keeps its base
            return staged
        missing = {name for name, t in targets.items() if isinstance(t, torch.nn.Parameter)}
        missing -= staged.keys()
        if missing and not self._tied_only(missing, set(staged)):
            raise KeyError(f"weight update for version {version} lacks {sorted(missing)[:3]}")
        return staged

    def _apply_staged(self) -> None:
        """The only step on the critical path: staging copy -> model weights, between steps."""
        staged = self._staged
        targets = self.model.state_dict(keep_vars=True)
        adapted = low_rank.targets(staged)
        with self._lock, torch.no_grad(), self.platform.profile_range("eddy.weights.apply"):
            for name, tensor in staged.items():
                if low_rank.target_of(name) is None:
                    targets[name].data.copy_(tensor.to(self.device))
                    self._base.pop(name, None)  # a whole weight is the new base
            for name in adapted:
                weight = targets[name].data
                base = self._base.setdefault(name, weight.clone())
                weight.copy_(low_rank.merged(base, *(staged[factor] for factor in
                                                     low_rank.factor_names(name))))
            self._gate.apply()
            self._staged = None

    def _tied_only(self, missing: set[str], seen: set[str]) -> bool:
        """A tied output head needs no separate tensor when its embedding was loaded."""
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        return tied and missing <= {"lm_head.weight"} and "model.embed_tokens.weight" in seen

    async def held_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The model's state dict (the names the trainer sends), staged weights over the
        hosted ones, copied to the host under the lock (in a thread: a decode step holds it),
        so an apply cannot land half way."""
        return await asyncio.to_thread(self._held_weights)

    def _held_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self._lock:
            staged = self._staged
            if self._base or (staged is not None and low_rank.targets(staged)):
                raise WeightsNotHeld("it holds LoRA factors merged onto its weights; the "
                                     "adapter itself is not among them")
            newest = staged or {}  # a weight staged is copied from there, not from the model
            weights = {name: t.detach().to("cpu", copy=True) for name, t in
                       {**self.model.state_dict(), **newest}.items()}
            return (self._gate.staged if staged is not None else self._gate.hosted), weights

    async def sleep(self) -> None:
        with self._lock:
            self.model.to("cpu")
            self._base = {name: t.to("cpu") for name, t in self._base.items()}
            self._sleeping = True
        self.platform.release_memory()

    async def wake(self) -> None:
        self.platform.restore_memory()
        with self._lock:
            self.model.to(self.device)
            self._base = {name: t.to(self.device) for name, t in self._base.items()}
            self._sleeping = False

    def configure(self, *, max_batch_size: int | None = None,
                  partial_rollout: bool | None = None) -> None:
        if max_batch_size is not None:
            if max_batch_size < 1:
                raise ValueError(f"max_batch_size = {max_batch_size}: must be >= 1")
            self.max_batch_size = max_batch_size  # from the next chunk a call starts
        if partial_rollout is not None:
            self._gate.partial_rollout = partial_rollout
            if self._gate.due():
                self._apply_staged()  # partial rollout takes new weights at once

    def stats(self) -> EngineStats:
        return EngineStats(running=self._gate.running, waiting=self._waiting,
                           version=self._gate.hosted, staged_version=self._gate.staged,
                           tokens_generated=self._tokens, busy_seconds=self._busy,
                           sleeping=self._sleeping)

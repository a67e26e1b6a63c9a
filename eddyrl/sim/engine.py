"""`sim`: an inference engine whose time comes from the cost model, for the cluster simulator.

It models what makes rollout slow at scale, on the loop's (virtual) clock:
- **continuous batching**: requests join the running batch at the next decode step (up to
  `max_batch_size`), each paying a prefill of its context on admission; a decode step of b
  sequences with mean context c takes `cost.decode_step_seconds(b, c)`;
- **priority scheduling**: waiting requests are admitted by (`priority`, arrival), and when the
  batch would overflow the KV cache (`kv_capacity_tokens`) the lowest-ranked running sequence
  is preempted (its tokens are kept and re-prefilled when it is admitted again, as vLLM's
  recompute preemption does);
- the **inference-engine contract** of `hf`: versions (a request joins the hosted version, waits
  for staged weights, or is refused), delayed weight updates (staged while requests run, applied
  once they drain; with partial rollout at the next step), abort with partial output, progress
  notes at `report_at` lengths. The version rules are the gate's (engines/inference/versions.py),
  asked for each sequence as it would enter the batch; a sequence holds the hosted version from
  its first admission to its final result, preempted or waiting for a tool included;
- **multi-turn episodes** (`episode_of`): a sequence at a tool call leaves the batch and keeps
  its KV cache while the tool runs; when KV runs out the lowest-ranked holder gives it up
  (sim/off_batch.py, `OffBatch`: the engine's part for sequences off the batch);
- the **weight update as a pause**, in the order Eddy's `vllm` engine takes it
  (scheduler/rollout_cost.py `WeightUpdate`): the weights arrive while decoding goes on (the
  runtime's transfer), then between two steps the engine stops (partial rollout: every running
  sequence is interrupted; otherwise the old version has drained), loads them and resets its
  prefix cache (`update.pause_s`: nothing decodes), and every interrupted sequence is
  prefilled again through the engine's token budget, `update.token_budget` tokens per step
  (CostModel.chunked_prefill_seconds), before it decodes on. Simplified: sequences whose
  chunks are done wait for the last chunk instead of decoding beside it, and a first prefill
  (short prompts in RL) is still one step of its own.

Events, not tokens: the batch changes only when a sequence finishes, reaches a progress
length or a tool call, the KV cache fills, or something arrives (a request, an abort, weights,
a tool's answer). Between two events the engine sleeps for all the decode steps in one go (the
step time taken at the mean context over the interval), so the work per request is a few heap
operations whatever its length. Token counts are kept as one global step counter minus a
per-sequence offset.

What a request generates is the workload's business: `length_of(request)` gives the tokens
the model generates in all, `episode_of(request)` its tool calls (the output is those tokens
and the calls' observations, resumed ones included, capped by max_new_tokens), and
`correct_of(request)` whether it is right, encoded as the value of every token id (1: correct,
0: wrong) so that a reward function can score the decoded text. Observation tokens carry the
same value, and the version of the tokens before them: the simulator's training cost counts
them; the loss mask that would exclude them is not modelled. Results use `Runs`, not lists.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import heapq
import itertools
import math
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterable, Sequence

from ..scheduler.cost_model import CostModel
from ..scheduler.rollout_cost import WeightUpdate
from ..engines.inference.base import InferenceEngine
from ..engines.inference.versions import Admission, VersionGate
from ..protocol import EngineStats, GenerationRequest, GenerationResult
from .off_batch import OffBatch
from .sequence import SimSequence, ToolWaits, default_kv_capacity

if TYPE_CHECKING:
    from .workload import ToolCall


class SimInferenceEngine(OffBatch, InferenceEngine):
    def __init__(self, cost: CostModel, *, length_of: Callable[[GenerationRequest], int],
                 correct_of: Callable[[GenerationRequest], bool], max_batch_size: int = 256,
                 kv_capacity_tokens: int | None = None, version: int = 0,
                 partial_rollout: bool = False,
                 trace: Callable[[str, float, float, dict], None] | None = None,
                 episode_of: Callable[[GenerationRequest], Sequence[ToolCall]] | None = None,
                 carry_kv: bool = False, update: WeightUpdate | None = None) -> None:
        """`trace(name, start_s, seconds, args)`, if given, receives every busy interval
        (prefill, decode) for a timeline. `episode_of(request)`, if given, gives a request's
        tool calls (single-turn without it). `carry_kv`: a request that arrives with tokens
        generated elsewhere (a migration) brings its KV cache over the instances' network link
        instead of re-prefilling it (DORA: caches of one version are interchangeable); the
        transfer takes this engine's time at admission. `update`: how it takes new weights
        (default: no load time, the default token budget)."""
        self.cost = cost
        # prefills repeat their arguments (RL prompts share a length; a tool's answer after the
        # same context): priced once each. The cost model is immutable (frozen parts).
        self._prefill_seconds = functools.lru_cache(maxsize=4096)(cost.prefill_seconds)
        self.length_of = length_of
        self.correct_of = correct_of
        self.max_batch_size = max_batch_size
        self.kv_capacity_tokens = kv_capacity_tokens or default_kv_capacity(cost)
        self.trace = trace
        self.episode_of = episode_of
        self.carry_kv = carry_kv
        self.update = update if update is not None else WeightUpdate(load_s=0.0)
        self._interrupted: set[SimSequence] = set()  # by a weight update: re-prefill in chunks
        self._pause_s = 0.0  # a weight load due before the next step
        self.update_pauses = 0  # weight loads taken
        # versions: hosted, staged, and the sequences that hold the hosted one (`seq.hosted`)
        self._gate = VersionGate(version, partial_rollout=partial_rollout)
        self._waiting: list[SimSequence] = []  # by rank: priority, then arrival
        self._running: dict[int, SimSequence] = {}
        # heaps of (engine step, id, sequence): when each ends, reports, calls a tool
        self._finishes: list[tuple[int, int, SimSequence]] = []
        self._reports: list[tuple[int, int, SimSequence]] = []
        self._calls: list[tuple[int, int, SimSequence]] = []
        self._tools = ToolWaits(self._tool_answered)  # waiting for a tool's answer
        self._held_kv = 0  # KV tokens of sequences that are not running (sum of their cached)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._step = 0  # decode steps taken by this engine
        self._context_base = 0  # sum over running of (prompt + tokens at step 0 of the offset)
        self._aborted: set[str] = set()
        self._interrupt = asyncio.Event()
        self._decoding: asyncio.Future | None = None  # resolved by an interrupt (`_decode_for`)
        self._server: asyncio.Task | None = None
        self._tokens = 0
        self._busy = 0.0
        self._sleeping = False
        self.preemptions = 0  # running sequences preempted, and idle ones' caches dropped

    @property
    def version(self) -> int:
        return self._gate.hosted

    @property
    def partial_rollout(self) -> bool:
        return self._gate.partial_rollout

    # ---- the contract ---------------------------------------------------------------------
    async def generate(self, requests: list[GenerationRequest]
                       ) -> AsyncIterator[GenerationResult]:
        if self._sleeping:
            raise RuntimeError("generate called on a sleeping engine; call wake() first")
        out: asyncio.Queue = asyncio.Queue()
        for request in requests:
            resumed = len(request.resume_ids)
            calls = tuple(self.episode_of(request)) if self.episode_of is not None else ()
            observations = sum(call.payload_tokens for call in calls)
            target = min(max(self.length_of(request) + observations, resumed + 1),
                         request.sampling.max_new_tokens)
            if resumed >= request.sampling.max_new_tokens:
                raise ValueError(f"request {request.request_id}: resumes with {resumed} tokens, "
                                 f"max_new_tokens is {request.sampling.max_new_tokens}")
            longest = len(request.prompt_ids) + request.sampling.max_new_tokens
            if longest > self.kv_capacity_tokens:
                raise ValueError(f"request {request.request_id}: prompt + max_new_tokens = "
                                 f"{longest} tokens exceed the KV cache's "
                                 f"{self.kv_capacity_tokens}")
            seq = SimSequence(request, out, target, int(self.correct_of(request)), resumed,
                       (request.priority, next(self._arrivals)), calls=calls)
            if self.carry_kv and resumed:
                seq.cached = seq.carried = self._context(seq)  # its cache comes with it
                self._held_kv += seq.cached
            self._arrive(seq)
        self._wake_server()
        remaining = len(requests)
        while remaining:
            result = await out.get()
            if isinstance(result, BaseException):
                raise result
            remaining -= result.final
            yield result

    async def abort(self, request_ids: Iterable[str]) -> None:
        self._aborted.update(request_ids)
        self._wake_server()

    async def load_weights(self, version: int, buckets=(), *, hold: bool = False) -> None:
        """Weights are a version number here; their transfer time is the runtime's. Idle, it
        applies them at once and the caller waits for the load; busy (partial rollout), at its
        next step boundary."""
        if self._gate.stage(version, hold=hold):
            self._apply_staged()  # idle: at once
            await self._load_pause()
        self._wake_server()

    async def pause_for(self, seconds: float) -> None:
        """Stop at the next step boundary for `seconds`: a system that pauses its rollout
        while the weights cross (verl's fully asynchronous trainer: its fully_async.md doc,
        "PartialRollout", volcengine/verl), where Eddy's engine goes on decoding into a staging
        copy."""
        self._pause_s += seconds
        self._wake_server()

    async def sleep(self) -> None:
        self._sleeping = True

    async def wake(self) -> None:
        self._sleeping = False

    def configure(self, *, max_batch_size: int | None = None,
                  partial_rollout: bool | None = None) -> None:
        if max_batch_size is not None:
            self.max_batch_size = max_batch_size
        if partial_rollout is not None:
            self._gate.partial_rollout = partial_rollout  # staged weights apply at the next step
        self._wake_server()

    def stats(self) -> EngineStats:
        # waiting: queued, or waiting for a tool (not idle: it comes back)
        return EngineStats(running=len(self._running),
                           waiting=len(self._waiting) + len(self._tools),
                           version=self._gate.hosted,
                           tokens_generated=self._tokens, busy_seconds=self._busy,
                           kv_cache_usage=self._kv_used() / self.kv_capacity_tokens,
                           staged_version=self._gate.staged, sleeping=self._sleeping)

    # ---- serving ----------------------------------------------------------------------------
    def _wake_server(self) -> None:
        self._interrupt.set()
        if self._decoding is not None and not self._decoding.done():
            self._decoding.set_result(True)
        if self._server is None or self._server.done():
            self._server = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        try:
            while True:
                self._interrupt.clear()
                if self._gate.due():  # partial rollout: the step under way has completed
                    self._apply_staged()
                await self._load_pause()
                if self._gate.due():  # staged while it paused to receive them
                    self._apply_staged()
                    await self._load_pause()
                self._settle_aborts()
                if not (self._running or self._waiting):
                    return  # a tool's answer wakes it again
                if self._waiting:  # (most turns, after a sequence ends, have none to admit)
                    await self._admit()
                if self._running:
                    await self._decode()
                elif self._waiting and not self._interrupt.is_set():
                    await self._interrupt.wait()  # e.g. waiting for weights that are not here
        except BaseException as exc:
            self._tools.cancel_all()
            for seq in [*self._running.values(), *self._waiting, *self._tools]:
                seq.out.put_nowait(exc)
            raise

    async def _admit(self) -> None:
        """Refuse what needs gone weights, switch to staged weights once the old version has
        drained, and move waiting sequences into the batch while it and the KV cache have room;
        their prefill takes the engine's time."""
        if self._gate.can_switch() and any(
                self._admission(seq) is Admission.WAIT for seq in self._waiting):
            self._apply_staged()
            await self._load_pause()
        prefill, kept, contexts = 0.0, [], []
        for index, seq in enumerate(self._waiting):
            admission = self._admission(seq)
            if admission is Admission.REFUSE:
                self._finish(seq, "refused")
                continue
            if admission is Admission.WAIT:
                seq.waited = True
                kept.append(seq)  # waits for the old version to drain; others may pass it
                continue
            # in rank order (priority, then first come, first served): once the head does not
            # fit, nothing behind it starts
            # (room for its context and a step of every sequence, or it would be preempted;
            # idle caches of lower-ranked sequences give way)
            if len(self._running) >= self.max_batch_size or not self._make_room(
                    self._context(seq) - seq.cached + len(self._running) + 1, seq.rank):
                kept.extend(self._waiting[index:])
                break
            if seq in self._interrupted:  # its context goes through the token budget below
                self._interrupted.discard(seq)
                contexts.append(self._context(seq))
            else:
                prefill += self._prefill_seconds(self._context(seq) - seq.cached, seq.cached)
            if seq.carried:  # a migrated cache lands before the sequence runs
                prefill += self.cost.kv_transfer_seconds(
                    seq.carried, self.cost.accelerator.inter_node_bandwidth)
                seq.carried = 0
            self._start(seq)
        self._waiting = kept
        if prefill:
            self._prefilled("prefill", prefill, {})
        reprefill = 0.0
        if contexts:  # after a weight update (partial rollout) only
            steps, reprefill = self.cost.chunked_prefill_seconds(contexts,
                                                                 self.update.token_budget)
            if reprefill:
                self._prefilled("re-prefill", reprefill, {
                    "sequences": len(contexts), "tokens": sum(contexts), "steps": steps})
        if prefill + reprefill:
            await asyncio.sleep(prefill + reprefill)

    def _prefilled(self, name: str, seconds: float, args: dict) -> None:
        self._busy += seconds
        if self.trace is not None:
            self.trace(name, asyncio.get_running_loop().time(), seconds,
                       {"running": len(self._running), "version": self._gate.hosted, **args})

    async def _load_pause(self) -> None:
        """New weights applied: the engine copies them into place and resets its prefix cache
        before its next step (or it pauses to receive them: `pause_for`); nothing decodes
        meanwhile."""
        if not self._pause_s:
            return
        seconds, self._pause_s = self._pause_s, 0.0
        self._busy += seconds
        if self.trace is not None:
            self.trace("weight update", asyncio.get_running_loop().time(), seconds,
                       {"version": self._gate.hosted})
        await asyncio.sleep(seconds)

    def _start(self, seq: SimSequence) -> None:
        sid = next(self._ids)
        seq.order = sid
        seq.offset = self._step - seq.tokens
        version = self._gate.token_version()
        if not seq.segments or seq.segments[-1][0] != version:
            seq.segments.append((version, seq.tokens))
        if seq.hosted is None:
            self._gate.started()  # from now on it holds the hosted version, until its end
        seq.hosted = version
        self._held_kv -= seq.cached
        seq.cached = 0
        self._running[sid] = seq
        self._context_base += len(seq.request.prompt_ids) - seq.offset
        heapq.heappush(self._finishes, (seq.offset + seq.target, sid, seq))
        for length in seq.request.report_at:
            if seq.tokens < length < seq.target:
                heapq.heappush(self._reports, (seq.offset + length, sid, seq))
        if self._call_step(seq) < seq.target:
            heapq.heappush(self._calls, (seq.offset + self._call_step(seq), sid, seq))

    async def _decode(self) -> None:
        """Decode until the next event: a sequence ends, reports or calls a tool, the KV cache
        fills, or something arrives (then the step under way completes first)."""
        batch = len(self._running)
        steps = self._next_event() - self._step
        room = (self.kv_capacity_tokens - self._kv_used()) // batch
        if room < 1:
            self._free_lowest()
            return
        steps = min(steps, room)
        mean_context = self._running_kv() / batch + steps / 2
        step_s = self.cost.decode_step_seconds(batch, mean_context)
        loop = asyncio.get_running_loop()
        began = loop.time()
        if await self._decode_for(steps * step_s):
            done = min(steps, math.floor((loop.time() - began) / step_s) + 1)
            await asyncio.sleep(began + done * step_s - loop.time())  # the step under way
        else:
            done = steps
        if self.trace is not None:
            self.trace("decode", began, done * step_s,
                       {"batch": batch, "steps": done, "version": self._gate.hosted})
        self._advance(done, batch, step_s)

    async def _decode_for(self, seconds: float) -> bool:
        """Wait `seconds`, or less if something arrives (`_wake_server`): whether it did.
        `asyncio.wait_for(self._interrupt.wait(), seconds)` with one future and one timer:
        wait_for wraps the wait in a task and cancels it at the timeout, several turns of the
        loop each time, and this is the wait of every decode interval of every engine."""
        if self._interrupt.is_set():
            return True
        loop = asyncio.get_running_loop()
        self._decoding = loop.create_future()
        timer = loop.call_later(seconds, _resolve, self._decoding, False)
        try:
            return await self._decoding
        finally:
            timer.cancel()
            self._decoding = None

    def _advance(self, steps: int, batch: int, step_s: float) -> None:
        self._step += steps
        self._tokens += steps * batch
        self._busy += steps * step_s
        while self._reports and self._reports[0][0] <= self._step:
            _, sid, seq = heapq.heappop(self._reports)
            if self._running.get(sid) is seq:
                seq.out.put_nowait(self._result(seq, "progress"))
        while self._calls and self._calls[0][0] <= self._step:
            _, sid, seq = heapq.heappop(self._calls)
            if self._running.get(sid) is seq:
                seq.cached = self._context(self._stop(sid))
                self._held_kv += seq.cached
                self._call_tool(seq)  # it keeps holding the hosted version (`seq.hosted`)
        while self._finishes and self._finishes[0][0] <= self._step:
            _, sid, seq = heapq.heappop(self._finishes)
            if self._running.get(sid) is seq:
                self._stop(sid)
                self._finish(seq, seq.end_reason)

    def _settle_aborts(self) -> None:
        if not self._aborted:
            return
        for sid, seq in list(self._running.items()):
            if seq.request.request_id in self._aborted:
                self._stop(sid)
                self._finish(seq, "abort")
        for seq in [s for s in self._waiting if s.request.request_id in self._aborted]:
            self._waiting.remove(seq)
            self._interrupted.discard(seq)
            self._finish(seq, "abort")
        for seq in [s for s in self._tools if s.request.request_id in self._aborted]:
            self._tools.cancel(seq)
            self._finish(seq, "abort")
        self._aborted.clear()

    def _queue(self, seq: SimSequence) -> None:
        bisect.insort(self._waiting, seq, key=lambda s: s.rank)

    def _stop(self, sid: int) -> SimSequence:
        seq = self._running.pop(sid)
        seq.tokens = self._step - seq.offset
        self._context_base -= len(seq.request.prompt_ids) - seq.offset
        return seq

    # ---- versions ---------------------------------------------------------------------------
    def _admission(self, seq: SimSequence) -> Admission:
        """The gate's answer for a waiting sequence: one that holds the hosted version
        (preempted, back from a tool) asks for it, others for their request's version."""
        version = seq.hosted if seq.hosted is not None else seq.request.version
        return self._gate.admit(version, waited=seq.waited,
                                resumed=bool(seq.request.resume_ids),
                                who=f"request {seq.request.request_id}")

    def _apply_staged(self) -> None:
        self._gate.apply()
        self._pause_s += self.update.pause_s
        self.update_pauses += 1
        # partial rollout: running sequences go on under the new weights, but their KV cache
        # came from the old ones, so they re-prefill their context first, as the `vllm` engine
        # does (it aborts them, resets its prefix cache and resumes them); idle caches go too
        for sid in list(self._running):
            seq = self._stop(sid)
            self._release(seq)  # held again when it re-enters the batch
            self._interrupted.add(seq)
            self._queue(seq)
        for seq in self._idle_holders():
            self._drop_cache(seq, preempted=False)

    def _release(self, seq: SimSequence) -> None:
        """It no longer holds the hosted version (ended, or switched by partial rollout)."""
        if seq.hosted is not None:
            seq.hosted = None
            self._gate.finished()

    # ---- bookkeeping ------------------------------------------------------------------------
    def _next_event(self) -> int:
        ends = self._finishes[0][0]
        if self._reports:
            ends = min(ends, self._reports[0][0])
        if self._calls:
            ends = min(ends, self._calls[0][0])
        return max(ends, self._step + 1)

    def _running_kv(self) -> int:
        return self._context_base + len(self._running) * self._step

    def _kv_used(self) -> int:
        return self._running_kv() + self._held_kv

    def _context(self, seq: SimSequence) -> int:
        return len(seq.request.prompt_ids) + seq.tokens

    def _finish(self, seq: SimSequence, reason: str) -> None:
        self._release(seq)
        self._held_kv -= seq.cached
        seq.cached = 0
        seq.out.put_nowait(self._result(seq, reason))

    def _result(self, seq: SimSequence, reason: str) -> GenerationResult:
        running = self._running.get(seq.order) is seq
        return seq.result(self._step - seq.offset if running else seq.tokens, reason)


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)

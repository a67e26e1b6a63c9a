"""Sequences off the simulated engine's batch (sim/engine.py): those waiting for a tool's
answer and those preempted or queued after one, with the KV cache they keep, and who gives it
up when the cache runs out. A part of `SimInferenceEngine` (its base class), kept apart because
it is its own job: the engine's serving loop only asks it for room (`_make_room`,
`_free_lowest`) and hands it sequences that reach a tool call (`_call_tool`).

- **multi-turn episodes** (`episode_of`): a sequence that reaches one of its tool calls leaves
  the batch, keeps its KV cache while the tool runs on the loop's clock (the engine is idle if
  nothing else runs), then queues again at its rank with the observation appended to its
  output, and pays only the prefill of the observation (its prefix is cached);
- when KV runs out, the lowest-ranked holder gives it up: a running sequence is preempted, an
  idle one (waiting for its tool, or queued after it) loses its cached prefix; either
  re-prefills its whole context when admitted again (vLLM's prefix cache would evict least
  recently used blocks instead of ranks, and keep no cache pinned).

The state is the engine's (`_running`, `_waiting`, `_tools`, `_held_kv`, `_gate`, ...: set in
`SimInferenceEngine.__init__`), as are the helpers called here (`_queue`, `_stop`, `_finish`,
`_result`, `_context`, `_kv_used`, `_wake_server`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import SimSequence


class OffBatch:
    """The engine's methods for sequences off the batch (module docstring)."""

    @property
    def tool_calls(self) -> int:
        return self._tools.calls

    @property
    def tool_failures(self) -> int:
        return self._tools.failures

    @property
    def tool_wait_s(self) -> float:
        """Sum of the time sequences waited for tools."""
        return self._tools.wait_s

    def _free_lowest(self) -> None:
        """Free the KV of the lowest-ranked holder (the newest arrival when priorities tie, as
        vLLM's FCFS scheduler does): recompute preemption of a running sequence, or the cache
        of an idle one."""
        idle = max(self._idle_holders(), key=lambda s: s.rank, default=None)
        sid = max(self._running, key=lambda s: self._running[s].rank)
        if idle is not None and idle.rank > self._running[sid].rank:
            self._drop_cache(idle)
            return
        self._queue(self._stop(sid))  # it keeps holding the hosted version (`seq.hosted`)
        self.preemptions += 1

    def _make_room(self, tokens: int, rank: tuple[int, int]) -> bool:
        """Whether `tokens` more fit in the KV cache, after dropping as many idle caches of
        sequences ranked below `rank` as that takes (lowest first)."""
        while self._kv_used() + tokens > self.kv_capacity_tokens:
            below = [seq for seq in self._idle_holders() if seq.rank > rank]
            if not below:
                return False
            self._drop_cache(max(below, key=lambda s: s.rank))
        return True

    def _idle_holders(self) -> list[SimSequence]:
        return [seq for seq in [*self._tools, *self._waiting] if seq.cached]

    def _drop_cache(self, seq: SimSequence, preempted: bool = True) -> None:
        self._held_kv -= seq.cached
        seq.cached = seq.carried = 0  # a migrated cache not yet landed is recomputed instead
        self.preemptions += preempted

    # ---- tools ------------------------------------------------------------------------------
    def _arrive(self, seq: SimSequence) -> None:
        """Queue a new sequence; a resumed one skips the calls it has passed, and one that
        stopped while its tool ran calls it again."""
        while seq.next_call < len(seq.calls) and self._call_step(seq) < seq.tokens:
            seq.observed += seq.calls[seq.next_call].payload_tokens
            seq.next_call += 1
        if self._call_step(seq) != seq.tokens:
            self._queue(seq)
            return
        versions = seq.request.resume_versions  # the answer's tokens carry the last version
        seq.segments.append((versions[-1] if versions else self._gate.hosted, seq.tokens))
        self._call_tool(seq)

    def _call_step(self, seq: SimSequence) -> int:
        """Output tokens at which it makes its next call (past the target if none is left)."""
        if seq.next_call >= len(seq.calls):
            return seq.target
        return seq.calls[seq.next_call].at + seq.observed

    def _call_tool(self, seq: SimSequence) -> None:
        """It waits for the call's answer off the batch (keeping the KV cache and the version
        the caller set)."""
        self._tools.call(seq)

    def _tool_answered(self, seq: SimSequence, payload: int) -> None:
        """The observation joins its output; it queues again at its rank."""
        before, seq.tokens = seq.tokens, min(seq.tokens + payload, seq.target)
        seq.observed += payload
        if any(before < length <= seq.tokens for length in seq.request.report_at):
            seq.out.put_nowait(self._result(seq, "progress"))
        if seq.tokens < seq.target:
            self._queue(seq)
        else:  # the answer reached max_new_tokens
            self._finish(seq, seq.end_reason)
        # either way the server looks again: it may be asleep with requests waiting for staged
        # weights until the old version drains, and this sequence may have been its last holder
        self._wake_server()

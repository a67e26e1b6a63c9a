"""What the simulated inference engine keeps per sequence, the KV capacity of an instance,
and the tool calls sequences wait on (on the loop's clock)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ..scheduler.cost_model import CostModel
from ..protocol import GenerationRequest, GenerationResult
from .runs import Runs

if TYPE_CHECKING:
    from .workload import ToolCall


@dataclass(eq=False, slots=True)
class SimSequence:
    request: GenerationRequest
    out: asyncio.Queue
    target: int  # output tokens (resumed and observations included) at which it ends
    token: int  # the id every output token carries
    tokens: int  # output so far, while not running (running: engine step - offset)
    rank: tuple[int, int]  # (priority, arrival): admitted lowest first, preempted highest first
    order: int = 0  # the running sequence's key (admission order)
    offset: int = 0
    # (version, token index it started at) for the tokens generated here: one entry unless
    # partial rollout changed the weights under it
    segments: list[tuple[int, int]] = field(default_factory=list)
    # the version it holds from its admission to its end, running or off the batch (preempted,
    # waiting for a tool); None: not admitted yet, or switched by partial rollout
    hosted: int | None = None
    waited: bool = False  # it waited for newer weights: it starts on the newest (versions.py)
    calls: Sequence[ToolCall] = ()  # its episode's tool calls
    next_call: int = 0  # index in calls of the next one it makes
    observed: int = 0  # observation tokens in its output (of the calls before next_call)
    cached: int = 0  # KV tokens it keeps while not running (after a tool call)
    carried: int = 0  # KV tokens brought by a migration, still to transfer at admission

    @property
    def end_reason(self) -> str:
        return "length" if self.target >= self.request.sampling.max_new_tokens else "stop"

    def result(self, tokens: int, reason: str) -> GenerationResult:
        """Its output so far (`tokens` long, resumed ones included) with every token's version."""
        request = self.request
        new = tokens - len(request.resume_ids)
        ends = [start for _, start in self.segments[1:]] + [tokens]
        versions = [(version, end - start) for (version, start), end in zip(self.segments, ends)]
        return GenerationResult(
            request.request_id, request.prompt_ids,
            _resumed_then(request.resume_ids, [(self.token, new)]),
            _resumed_then(request.resume_logprobs, [(0.0, new)]),
            _resumed_then(request.resume_versions, versions), reason)


def _resumed_then(resumed: Sequence, runs: list[tuple[object, int]]) -> Runs:
    """`Runs.of(resumed) + Runs(runs)`, built in one go: a result is built at every finish and
    progress note, and most requests resume nothing."""
    if not resumed:
        return Runs(runs)
    return Runs([*Runs.of(resumed).runs(), *runs])


class ToolWaits:
    """Sequences waiting off the batch for their tool's answer (a timer each on the loop's
    clock), and the counts of calls, failures and time waited."""

    def __init__(self, answered: Callable[[SimSequence, int], None]) -> None:
        self._answered = answered
        self.timers: dict[SimSequence, asyncio.TimerHandle] = {}
        self.calls = 0
        self.failures = 0
        self.wait_s = 0.0

    def call(self, seq: SimSequence) -> None:
        """Its next call starts; the answer arrives `latency_s` later."""
        call = seq.calls[seq.next_call]
        seq.next_call += 1
        self.calls += 1
        self.failures += call.failed
        self.wait_s += call.latency_s
        self.timers[seq] = asyncio.get_running_loop().call_later(
            call.latency_s, self._answer, seq, call.payload_tokens)

    def _answer(self, seq: SimSequence, payload: int) -> None:
        del self.timers[seq]
        self._answered(seq, payload)

    def cancel(self, seq: SimSequence) -> None:
        """Aborted while waiting: no answer comes, and the time not waited is not counted."""
        handle = self.timers.pop(seq)
        handle.cancel()
        self.wait_s -= handle.when() - asyncio.get_running_loop().time()

    def cancel_all(self) -> None:
        for handle in self.timers.values():
            handle.cancel()

    def __len__(self) -> int:
        return len(self.timers)

    def __iter__(self):
        return iter(list(self.timers))


def default_kv_capacity(cost: CostModel, memory_fraction: float = 0.9) -> int:
    """Tokens of KV cache that fit beside the weights on the instance's tp devices."""
    free = cost.accelerator.hbm_bytes * cost.tp * memory_fraction - cost.weights_bytes
    per_token = cost.model.kv_bytes_per_token(cost.dtype_bytes)
    if free <= per_token:
        raise ValueError(f"{cost.model.name} on {cost.tp} × {cost.accelerator.name}: the weights "
                         f"leave no room for a KV cache; use a larger tp")
    return int(free // per_token)

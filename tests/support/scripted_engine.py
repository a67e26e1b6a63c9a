"""A scripted inference engine for deterministic rollout tests: the `hf` engine's version
contract without a model, stepping on the event loop only (no threads, no clock).

- The version gate's rules (eddyrl/engines/inference/versions.py), asked once per generate call:
  a request of the hosted version joins at once; of a newer version it waits for the running
  requests to drain, then the newest staged weights are applied; of an older one it is refused.
- `load_weights` stages; an idle engine not told to `hold` (or one with partial rollout)
  applies at once.
- Every turn is `turn_tokens` tokens: `token` repeated, then `STOP` ("stop"); each carries
  log-prob -1 and the version that produced it. `max_new_tokens` counts resumed tokens.
- `holds[group_id]`: while that asyncio.Event is clear, the group's requests make no progress
  (nor do the others of their generate call): a busy engine, for as long as a test wants.
"""

from __future__ import annotations

import asyncio

from eddyrl.engines.inference.versions import VersionGate, wait_for_admission
from eddyrl.protocol import EngineStats, GenerationResult

STOP = 2


class ScriptedEngine:
    def __init__(self, token: int, *, turn_tokens: int = 3, partial_rollout: bool = False):
        self.token = token
        self.turn_tokens = turn_tokens
        self.gate = VersionGate(0, partial_rollout=partial_rollout)
        self.holds: dict[str, asyncio.Event] = {}
        self.started: list[tuple[str, int]] = []  # (request id, version) per request run
        self._tokens = 0
        self._aborted: set[str] = set()
        self._drained = asyncio.Event()
        self._drained.set()

    @property
    def version(self) -> int:
        return self.gate.hosted

    @property
    def partial_rollout(self) -> bool:
        return self.gate.partial_rollout

    @property
    def _running(self) -> int:
        return self.gate.running

    async def generate(self, requests):
        if not await wait_for_admission(self.gate, requests[0].version,
                                        f"request {requests[0].request_id}",
                                        apply_staged=self.gate.apply, drained=self._drained,
                                        resumed=any(r.resume_ids for r in requests)):
            for r in requests:
                yield GenerationResult(r.request_id, list(r.prompt_ids), list(r.resume_ids),
                                       list(r.resume_logprobs), list(r.resume_versions),
                                       "refused")
            return
        rows = [(r, list(r.resume_ids), list(r.resume_logprobs), list(r.resume_versions))
                for r in requests]
        self.started += [(r.request_id, self.version) for r in requests]
        self.gate.started(len(rows))
        self._drained.clear()
        try:
            while rows:
                await asyncio.sleep(0)
                for row in list(rows):
                    request, tokens, logprobs, versions = row
                    hold = self.holds.get(request.request_id.rsplit("-", 1)[0])
                    if hold is not None:
                        await hold.wait()
                    if request.request_id in self._aborted:
                        self._aborted.discard(request.request_id)
                        reason = "abort"
                    else:
                        new = len(tokens) - len(request.resume_ids) + 1
                        tokens.append(STOP if new == self.turn_tokens else self.token)
                        logprobs.append(-1.0)
                        versions.append(self.gate.token_version())
                        self._tokens += 1
                        reason = "stop" if tokens[-1] == STOP else \
                            "length" if len(tokens) >= request.sampling.max_new_tokens else None
                    if reason is not None:
                        rows.remove(row)
                        self.gate.finished()
                        yield GenerationResult(request.request_id, list(request.prompt_ids),
                                               tokens, logprobs, versions, reason)
        finally:
            self.gate.finished(len(rows))
            if self.gate.running == 0:
                self._drained.set()

    async def abort(self, request_ids):
        self._aborted.update(request_ids)

    async def load_weights(self, version, buckets=(), *, hold=False):
        self.gate.stage(version, hold=hold)
        if self.gate.due():
            self.gate.apply()

    def stats(self) -> EngineStats:
        return EngineStats(running=self.gate.running, waiting=0, version=self.version,
                           tokens_generated=self._tokens, busy_seconds=0.0,
                           staged_version=self.gate.staged)


async def until(condition, steps: int = 10_000):
    """Let the event loop run until `condition()` holds (deterministic: no clock)."""
    for _ in range(steps):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never met")

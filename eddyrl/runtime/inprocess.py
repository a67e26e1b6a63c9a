"""A runtime whose inference engines live in this process and which has no trainer: what `eddy
eval` uses to run the controller's held-out evaluation without starting Ray, and what tests
use to drive the real controller and rollout against real engines."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Sequence

from ..engines.inference.base import InferenceEngine
from ..protocol import EngineStats, GenerationRequest, GenerationResult


class InProcessRuntime:
    workers: list[InferenceEngine]

    def __init__(self, engine: InferenceEngine | list[InferenceEngine]) -> None:
        self.workers = list(engine) if isinstance(engine, list) else [engine]
        self.engine = self.workers[0]

    def now(self) -> float:
        return time.monotonic()

    def generate(self, worker: int, requests: list[GenerationRequest]
                 ) -> AsyncIterator[GenerationResult]:
        return self.workers[worker].generate(requests)

    async def abort(self, worker: int, request_ids: list[str]) -> None:
        await self.workers[worker].abort(request_ids)

    async def worker_stats(self) -> list[EngineStats]:
        return [engine.stats() for engine in self.workers]

    async def train(self, batch: Any, replicas: Sequence[int] = ()) -> dict[str, float]:
        raise NotImplementedError("the in-process runtime evaluates only; use `eddy train`")

    async def sync_weights(self, version: int, hold: Sequence[int] = ()) -> list[int]:
        raise NotImplementedError("the in-process runtime evaluates only; use `eddy train`")

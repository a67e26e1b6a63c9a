"""A runtime with one inference engine in this process and no trainer: what `eddy eval` uses to
run the controller's held-out evaluation without starting Ray."""

from __future__ import annotations

import time
from typing import AsyncIterator

from ..engines.inference.base import GenerationRequest, GenerationResult, InferenceEngine


class InProcessRuntime:
    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.workers = [engine]

    def now(self) -> float:
        return time.monotonic()

    def generate(self, worker: int, requests: list[GenerationRequest]
                 ) -> AsyncIterator[GenerationResult]:
        return self.workers[worker].generate(requests)

    async def train(self, batch):
        raise NotImplementedError("the in-process runtime evaluates only; use `eddy train`")

    async def sync_weights(self, version: int) -> None:
        raise NotImplementedError("the in-process runtime evaluates only; use `eddy train`")

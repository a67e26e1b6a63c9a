"""The inference-engine contract: async, request-level generation that records, for every
generated token, its log-probability and the policy version that produced it."""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterable

from ...protocol import EngineStats, GenerationRequest, GenerationResult

if TYPE_CHECKING:
    import torch

    from ...hal import Platform, WeightBucketSpec
    from .stop_strings import StopStrings


@dataclass
class OutputSoFar:
    """A request's output as an engine builds it: its tokens, the sampled tokens' log-probs
    and versions, resumed ones included (a partial rollout or a migration continues them),
    and the watch for its stop strings. Each engine adds how its own steps extend it."""

    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stops: StopStrings | None = None  # watches the generated text for stop strings

    def __post_init__(self) -> None:
        self.tokens = list(self.request.resume_ids)
        self.logprobs = list(self.request.resume_logprobs)
        self.versions = list(self.request.resume_versions)


def engine_dtype(platform: Platform, name: str) -> torch.dtype:
    """The torch dtype an engine runs in (`rollout.dtype`, by its torch name: float32,
    bfloat16, float16), refused by key where the platform has no such dtype."""
    import torch

    from ...errors import ConfigError

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.bfloat16,
                                                            torch.float16):
        raise ConfigError(f"config key 'rollout.dtype' = {name!r} is not an engine dtype; "
                          "allowed: float32, bfloat16, float16 (fp32, bf16, fp16 in the config)")
    if not platform.supports_dtype(dtype):
        raise ConfigError(f"config key 'rollout.dtype' = {name!r} is not supported on "
                          f"platform {platform.name!r}; use fp32")
    return dtype


def longest_request(max_positions: int, max_model_len: int | None) -> int:
    """The longest request an engine takes: the run's longest sequence when the runtime says
    it (`max_model_len`), within the model's positions."""
    return max_positions if max_model_len is None else min(max_positions, max_model_len)


def check_request(request: GenerationRequest, max_positions: int) -> None:
    """What an engine that runs a real model refuses before starting a request: more tokens
    than the model has positions, nothing left to generate, a history of unequal lengths."""
    total = len(request.prompt_ids) + request.sampling.max_new_tokens
    if total > max_positions:
        raise ValueError(f"request {request.request_id}: prompt ({len(request.prompt_ids)} "
                         f"tokens) + max_new_tokens ({request.sampling.max_new_tokens}) "
                         f"exceeds the model's {max_positions} positions")
    if len(request.resume_ids) >= request.sampling.max_new_tokens:
        raise ValueError(f"request {request.request_id}: resumes with "
                         f"{len(request.resume_ids)} tokens, max_new_tokens is "
                         f"{request.sampling.max_new_tokens}; nothing is left to generate")
    if len(request.resume_logprobs) != len(request.resume_ids) or \
            len(request.resume_versions) != len(request.resume_ids):
        raise ValueError(f"request {request.request_id}: resume ids, log-probs and versions "
                         "differ in length")


class WeightsNotHeld(Exception):
    """An engine cannot give back the weights it decodes with (`held_weights`): why."""


class InferenceEngine(abc.ABC):
    """One rollout worker's engine. Every method is safe to call while `generate` runs."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the loaded weights."""

    @abc.abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> AsyncIterator[GenerationResult]:
        """Yield one final result per request, in completion order (aborted ones with
        finish_reason "abort" and the tokens produced so far; ones whose `version` this engine
        no longer hosts with "refused", so the caller can place them elsewhere), and before
        it a "progress" result at each of its `report_at` lengths the engine passes."""

    @abc.abstractmethod
    async def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these requests; their partial results come out of `generate`."""

    @abc.abstractmethod
    async def load_weights(self, version: int, buckets: Iterable[dict[str, torch.Tensor]],
                           *, hold: bool = False) -> None:
        """Replace the weights bucket by bucket; new tokens then carry `version`. Applied at
        once when nothing of the hosted version runs (or with partial rollout), else staged
        until that has drained; `hold` stages them even on an idle engine, because requests of
        the hosted version will come back (multi-turn episodes waiting for their tools): they
        apply when a request of a newer version finds nothing of the old one running."""

    @abc.abstractmethod
    async def sleep(self) -> None:
        """Free device memory (weights and cache) until `wake`."""

    @abc.abstractmethod
    async def wake(self) -> None:
        ...

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        ...

    async def wait_idle(self, poll_s: float = 0.01) -> None:
        """Return once no request runs or waits here: requests aborted to move elsewhere leave
        at the engine's next step, after the caller's books already show them gone."""
        while True:
            stats = self.stats()
            if not stats.running and not stats.waiting:
                return
            await asyncio.sleep(poll_s)

    # ---- optional: the engine's own processes receive the weight broadcast ---------------
    def weight_ranks(self) -> int:
        """Ranks the engine's own processes take in a `collective` weight channel (one per
        process holding part of the model, e.g. each tensor-parallel worker). 0, the default:
        the worker process receives each bucket and hands it to `load_weights`."""
        return 0

    def connect_weight_channel(self, rendezvous: str, rank_offset: int, world_size: int,
                               timeout_s: float = 600.0, address: str | None = None) -> None:
        """Join the trainer's broadcast group (rank 0 sends) as ranks `rank_offset` ...
        `rank_offset + weight_ranks() - 1`; only engines whose `weight_ranks()` is > 0.
        `address`: this node's cluster address, where the engine's processes put their
        collective sockets (`Platform.use_network`); None keeps a `file://` group on
        loopback."""
        raise NotImplementedError(f"{type(self).__name__} does not receive weights itself")

    async def receive_weights(self, version: int, specs: list[WeightBucketSpec]) -> None:
        """`load_weights`, each bucket taken off the broadcast by the engine's own processes
        (`connect_weight_channel` first), with the same version semantics."""
        raise NotImplementedError(f"{type(self).__name__} does not receive weights itself")

    # ---- optional: the weights given back, for a trainer rebuilt without buddy copies -----
    async def held_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest whole weights this engine holds (staged to apply, else hosted) and their
        version: every weight the trainer sends, under the trainer's (Hugging Face) names, full
        (not a tensor-parallel slice), on the host, in the engine's dtype. A trainer that lost a
        rank without buddy copies starts again from them (runtime/ray/published_rebuild.py).
        An engine that cannot give them back raises `WeightsNotHeld`, saying why."""
        raise WeightsNotHeld(f"the {type(self).__name__} engine cannot give its weights back")

    def configure(self, *, max_batch_size: int | None = None,
                  partial_rollout: bool | None = None) -> None:
        """Change the generation strategy while running (the adaptive scheduler's plans):
        sequences decoded together, and whether new weights reach running trajectories."""
        raise NotImplementedError(f"{type(self).__name__} cannot change its generation "
                                  "strategy while running")

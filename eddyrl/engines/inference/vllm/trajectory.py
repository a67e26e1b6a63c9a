"""One request's trajectory in the `vllm` engine: its tokens so far (resumed ones included),
the sampled token's log-prob and the policy version of each, read off vLLM's streamed deltas,
and the stop-string watch over them. It outlives the vLLM requests (segments) that extend it."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import OutputSoFar
from ....protocol import GenerationResult


@dataclass
class Trajectory(OutputSoFar):
    def extend(self, token_ids, logprobs, version: int) -> bool:
        """Append the new tokens; True (and the rest dropped) at one completing a stop string."""
        if len(token_ids) != len(logprobs or ()):
            raise RuntimeError(f"vLLM returned {len(token_ids)} tokens but "
                               f"{len(logprobs or ())} log-probs for {self.request.request_id}")
        for token, entry in zip(token_ids, logprobs):
            self.tokens.append(token)
            self.logprobs.append(entry[token].logprob)  # the sampled token is always there
            self.versions.append(version)
            if self.stops is not None and self.stops.push(token):
                return True
        return False

    def result(self, reason: str, length: int | None = None) -> GenerationResult:
        end = len(self.tokens) if length is None else length
        return GenerationResult(self.request.request_id, list(self.request.prompt_ids),
                                self.tokens[:end], self.logprobs[:end], self.versions[:end],
                                reason)

"""One request's trajectory in the `vllm` engine: its tokens so far (resumed ones included),
the sampled token's log-prob and the policy version of each, read off vLLM's streamed deltas,
and the stop-string watch over them. It outlives the vLLM requests (segments) that extend it."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import OutputSoFar
from ..routing import from_vllm, input_rows
from ....protocol import GenerationResult, RoutedExperts


@dataclass
class Trajectory(OutputSoFar):
    # routing replay: the experts of its input tokens, from its last finished segment
    experts: RoutedExperts | None = None

    def keep_experts(self, routed, num_experts: int) -> None:
        """A finished segment's routed experts: its whole sequence, of which the rows earlier
        segments or the resumed request already had are kept (the routing their tokens'
        log-probs came from; a segment after a weight switch routes them again)."""
        if routed is not None:
            earlier = self.experts if self.experts is not None else self.request.resume_experts
            self.experts = from_vllm(routed, num_experts, earlier)

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
        experts = self.request.resume_experts if self.experts is None else \
            self.experts.head(input_rows(len(self.request.prompt_ids), end))
        return GenerationResult(self.request.request_id, list(self.request.prompt_ids),
                                self.tokens[:end], self.logprobs[:end], self.versions[:end],
                                reason, routed_experts=experts)

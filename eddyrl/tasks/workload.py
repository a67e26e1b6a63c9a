"""Synthetic RL workloads for the simulator: prompts, and what each request will generate.

A workload says, for every prompt, how long its prompt is and how hard it is, and for every
request (by its id) how many tokens it generates and whether it is right. Everything is drawn
from a seeded hash of the ids, so a request resumed or regenerated elsewhere makes the same
response, and a run is deterministic for a seed whatever the order of events.

Response lengths are log-normal (heavy right tail), scaled to the configured mean and cut at
`max_response_tokens` (DAPO-Math with Qwen3: mean about 2.4K tokens, longest 30K). Each prompt
has a solve rate drawn from Beta(a, b) and each response is right with that probability, so
some groups have all-equal rewards (dynamic sampling drops them), as with real data.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from ..engines.inference.base import GenerationRequest
from ..validation import check_range
from .prompts import Prompt, PromptSet

CORRECT = "1"  # the answer every synthetic prompt expects; a simulated token carries 1 or 0
EVAL_KEYS = 1 << 30


@dataclass(kw_only=True, slots=True)
class WorkloadConfig:
    prompts: int = 4096  # distinct prompts in the data set
    eval_prompts: int = 32
    prompt_tokens: int = 512
    mean_response_tokens: float = 2400.0
    max_response_tokens: int = 30000
    length_sigma: float = 1.0  # of the log-normal: larger, heavier tail
    solve_a: float = 2.0  # Beta(a, b) of each prompt's solve rate
    solve_b: float = 2.0

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.prompts", self.prompts, 1)
        check_range(f"{prefix}.eval_prompts", self.eval_prompts, 1)
        check_range(f"{prefix}.prompt_tokens", self.prompt_tokens, 1)
        check_range(f"{prefix}.mean_response_tokens", self.mean_response_tokens, 1)
        check_range(f"{prefix}.max_response_tokens", self.max_response_tokens, 1)
        check_range(f"{prefix}.length_sigma", self.length_sigma, 0)
        check_range(f"{prefix}.solve_a", self.solve_a, 0, lo_open=True)
        check_range(f"{prefix}.solve_b", self.solve_b, 0, lo_open=True)


class Workload:
    def __init__(self, config: WorkloadConfig, seed: int) -> None:
        config.validate("workload")
        self.config = config
        self.seed = seed
        # log-normal with E = exp(mu + sigma^2/2) = mean
        self._mu = math.log(config.mean_response_tokens) - config.length_sigma ** 2 / 2

    def prompt_sets(self) -> tuple[PromptSet, PromptSet]:
        """(train, eval) prompts. A prompt's last token id is its key (eval prompts' keys start
        at EVAL_KEYS), which is how an engine that sees only a request knows whose it is."""
        def prompts(prefix: str, count: int, first_key: int) -> PromptSet:
            filler = self.config.prompt_tokens - 1
            return PromptSet([Prompt(i, f"{prefix}{i}", CORRECT,
                                     (0,) * filler + (first_key + i,))
                              for i in range(count)], truncated=0)
        return (prompts("p", self.config.prompts, 0),
                prompts("e", self.config.eval_prompts, EVAL_KEYS))

    def _draw(self, *key: object) -> random.Random:
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "little"))

    def response_tokens(self, request: GenerationRequest) -> int:
        rng = self._draw("length", request.request_id)
        tokens = rng.lognormvariate(self._mu, self.config.length_sigma)
        return max(1, min(self.config.max_response_tokens, round(tokens)))

    def correct(self, request: GenerationRequest) -> bool:
        solve_rate = self._draw("prompt", request.prompt_ids[-1]).betavariate(
            self.config.solve_a, self.config.solve_b)
        return self._draw("correct", request.request_id).random() < solve_rate


def decode(ids) -> str:
    """A simulated response's text: the value its tokens carry."""
    return str(ids[-1]) if len(ids) else ""


def reward(response: str, answer: str) -> float:
    return float(response == answer)

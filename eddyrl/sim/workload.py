"""Synthetic RL workloads for the simulator: prompts, and what each request will generate.

A workload says, for every prompt, how long its prompt is and how hard it is, and for every
request (by its id) how many tokens it generates and whether it is right. Everything is drawn
from a seeded hash of the ids, so a request resumed or regenerated elsewhere makes the same
response, and a run is deterministic for a seed whatever the order of events.

Response lengths are log-normal (heavy right tail), scaled to the configured mean and cut at
`max_response_tokens` (DAPO-Math with Qwen3: mean about 2.4K tokens, longest 30K). Each prompt
has a solve rate drawn from Beta(a, b) and each response is right with that probability, so
some groups have all-equal rewards (dynamic sampling drops them), as with real data.

Agentic workloads (`tool_calls_mean > 0`) make each request a multi-turn episode: the model
generates, calls a tool at some of its own tokens, waits for it, reads the observation the tool
returns (appended to its context) and goes on. `episode(request)` says where the calls fall
and what each costs: a log-normal latency and observation length, or, for a failed call, the
timeout and a short error text. `response_tokens` stays the model's own tokens.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Literal

from ..protocol import GenerationRequest
from ..validation import check_range
from ..tasks.prompts import Prompt, PromptSet

CORRECT = "1"  # the answer every synthetic prompt expects; a simulated token carries 1 or 0
EVAL_KEYS = 1 << 30
LARGE_PAYLOAD_TOKENS = 512  # a tool observation this long or longer is "large"


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
    # multi-turn episodes (0 tool calls: single-turn). Calls per episode are geometric (after
    # each call the model calls again with probability mean / (1 + mean)), cut at max_tool_calls
    tool_calls_mean: float = 0.0
    max_tool_calls: int = 16
    tool_latency_s: float = 2.0  # mean of a successful call's log-normal latency
    tool_latency_sigma: float = 1.0
    tool_payload_tokens: float = 256.0  # mean of the log-normal observation it returns
    tool_payload_sigma: float = 1.0
    tool_failure_rate: float = 0.0  # a failed call returns after tool_timeout_s with an error
    tool_timeout_s: float = 30.0
    tool_error_tokens: int = 32

    @property
    def longest_sequence(self) -> int:
        """The longest sequence a run of this workload holds: a prompt and a full response."""
        return self.prompt_tokens + self.max_response_tokens

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.prompts", self.prompts, 1)
        check_range(f"{prefix}.eval_prompts", self.eval_prompts, 1)
        check_range(f"{prefix}.prompt_tokens", self.prompt_tokens, 1)
        check_range(f"{prefix}.mean_response_tokens", self.mean_response_tokens, 1)
        check_range(f"{prefix}.max_response_tokens", self.max_response_tokens, 1)
        check_range(f"{prefix}.length_sigma", self.length_sigma, 0)
        check_range(f"{prefix}.solve_a", self.solve_a, 0, lo_open=True)
        check_range(f"{prefix}.solve_b", self.solve_b, 0, lo_open=True)
        check_range(f"{prefix}.tool_calls_mean", self.tool_calls_mean, 0)
        check_range(f"{prefix}.max_tool_calls", self.max_tool_calls, 0)
        check_range(f"{prefix}.tool_latency_s", self.tool_latency_s, 0, lo_open=True)
        check_range(f"{prefix}.tool_latency_sigma", self.tool_latency_sigma, 0)
        check_range(f"{prefix}.tool_payload_tokens", self.tool_payload_tokens, 1)
        check_range(f"{prefix}.tool_payload_sigma", self.tool_payload_sigma, 0)
        check_range(f"{prefix}.tool_failure_rate", self.tool_failure_rate, 0, 1)
        check_range(f"{prefix}.tool_timeout_s", self.tool_timeout_s, 0)
        check_range(f"{prefix}.tool_error_tokens", self.tool_error_tokens, 1)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of an episode. The model issues it after `at` tokens of its own (observations
    not counted); `payload_tokens` of observation (or error text, if it `failed`) come back
    after `latency_s`."""
    at: int
    latency_s: float
    payload_tokens: int
    failed: bool = False

    @property
    def size_class(self) -> Literal["small", "large"]:
        return "large" if self.payload_tokens >= LARGE_PAYLOAD_TOKENS else "small"


class Workload:
    def __init__(self, config: WorkloadConfig, seed: int) -> None:
        config.validate("workload")
        self.config = config
        self.seed = seed
        self.lengths = ResponseLengths.of(config)
        # prompt key -> its solve rate: every response of a group asks for it, and a seeded
        # draw (a Mersenne Twister seeded afresh) costs more than the rest of `correct`
        self._solve_rates: dict[int, float] = {}

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
        tokens = rng.lognormvariate(self.lengths.mu, self.lengths.sigma)
        return max(1, min(self.lengths.cap, round(tokens)))

    def correct(self, request: GenerationRequest) -> bool:
        return self._draw("correct", request.request_id).random() < self.solve_rate(
            request.prompt_ids[-1])

    def solve_rate(self, key: int) -> float:
        """The probability that a response to the prompt with this key is right."""
        rate = self._solve_rates.get(key)
        if rate is None:
            rate = self._solve_rates[key] = self._draw("prompt", key).betavariate(
                self.config.solve_a, self.config.solve_b)
        return rate

    def episode(self, request: GenerationRequest) -> tuple[ToolCall, ...]:
        """The request's tool calls, in order, each at a distinct token count in
        [1, response_tokens). Every call draws from its own seed, so the failure rate changes
        which calls fail, not the others' latencies and payloads."""
        config = self.config
        if not config.tool_calls_mean:
            return ()
        length = self.response_tokens(request)
        rng = self._draw("tools", request.request_id)
        again = config.tool_calls_mean / (1 + config.tool_calls_mean)
        count = 0
        while count < min(config.max_tool_calls, length - 1) and rng.random() < again:
            count += 1
        calls = []
        for index, at in enumerate(sorted(rng.sample(range(1, length), count))):
            call = self._draw("tool", request.request_id, index)
            latency = call.lognormvariate(
                _log_normal_mu(config.tool_latency_s, config.tool_latency_sigma),
                config.tool_latency_sigma)
            payload = call.lognormvariate(
                _log_normal_mu(config.tool_payload_tokens, config.tool_payload_sigma),
                config.tool_payload_sigma)
            if call.random() < config.tool_failure_rate:
                calls.append(ToolCall(at, config.tool_timeout_s, config.tool_error_tokens, True))
            else:
                calls.append(ToolCall(at, latency, max(1, round(payload))))
        return tuple(calls)


class ResponseLengths:
    """The workload's response lengths: log-normal with its mean and sigma, capped at
    `max_response_tokens`; and their partial moments, for what sizes by expected work."""

    def __init__(self, mean: float, sigma: float, cap: int) -> None:
        self.mu, self.sigma, self.cap = _log_normal_mu(mean, sigma), sigma, cap

    @classmethod
    def of(cls, config: WorkloadConfig) -> ResponseLengths:
        return cls(config.mean_response_tokens, config.length_sigma,
                   config.max_response_tokens)

    def _tail(self, k: int, t: float) -> float:
        """P'(L > t) under the k-th moment's tilt: Phi((mu + k sigma^2 - ln t) / sigma)."""
        z = (self.mu + k * self.sigma ** 2 - math.log(t)) / self.sigma
        return 0.5 * math.erfc(-z / math.sqrt(2))

    def moment_above(self, k: int, t: float) -> float:
        """E[min(L, cap)^k ; L > t] (needs sigma > 0)."""
        raw = math.exp(k * self.mu + (k * self.sigma) ** 2 / 2)
        return raw * (self._tail(k, t) - self._tail(k, self.cap)) + \
            self.cap ** k * self._tail(0, self.cap)


def _log_normal_mu(mean: float, sigma: float) -> float:
    """mu of the log-normal with this mean and sigma: E = exp(mu + sigma^2 / 2)."""
    return math.log(mean) - sigma ** 2 / 2


def decode(ids) -> str:
    """A simulated response's text: the value its tokens carry."""
    return str(ids[-1]) if len(ids) else ""


def reward(response: str, answer: str) -> float:
    return float(response == answer)

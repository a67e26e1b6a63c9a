"""The types every layer shares: what a rollout worker is asked (`SamplingParams`,
`GenerationRequest`) and answers (`GenerationResult`, `EngineStats`), what the rollout makes of
it (`Trajectory`, `Group`), what a tool return tells the router (`ToolState`) and what a
training step consumes (`TrainBatch`).

Every package may import this module and it imports none of them, so `core/`, `engines/`,
`envs/`, `scheduler/` and `sim/` meet here instead of importing each other. It loads no torch:
`TrainBatch` holds tensors but only calls their methods (torch appears in annotations only).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal, Sequence

if TYPE_CHECKING:
    import torch

# ---- generation: the inference-engine contract's request and result ---------------------

@dataclass(slots=True)
class RoutedExperts:
    """The experts a mixture-of-experts model routed each input token to: [tokens, layers,
    top_k] expert ids, flat and row-major in `ids`, -1 where unknown. Row t is token t of
    prompt + response *as an input*; a response's last token is never an input (nothing
    after it is computed), so a finished trajectory has len(prompt) + len(response) - 1
    rows. One byte per id (`array('b')`) up to 128 experts, two (`'h'`) beyond: a 4-layer
    top-2 trajectory of 1,000 tokens is 8 kB (engines/inference/routing.py records it)."""

    layers: int
    top_k: int
    ids: array

    @property
    def num_tokens(self) -> int:
        return len(self.ids) // max(self.layers * self.top_k, 1)

    def head(self, tokens: int) -> "RoutedExperts":
        """Its first `tokens` rows."""
        return RoutedExperts(self.layers, self.top_k,
                             self.ids[:tokens * self.layers * self.top_k])

    def as_tensor(self) -> torch.Tensor:
        """[tokens, layers, top_k] int8 or int16, as stored (torch imported here: this
        module loads none when imported)."""
        import torch

        dtype = torch.int8 if self.ids.typecode == "b" else torch.int16
        flat = torch.frombuffer(bytearray(self.ids.tobytes()), dtype=dtype) if self.ids \
            else torch.zeros(0, dtype=dtype)
        return flat.view(-1, self.layers, self.top_k)


FinishReason = Literal["stop", "length", "abort", "refused", "progress"]

@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    # Texts that end the request ("stop") at the generated token that completes one; that token
    # is kept and the tokens come back exactly as sampled (stop_strings.py: how both real
    # engines decode and match). For stops a tokenizer may spell in several tokens (tool tags).
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # per-request seed, for reproducible sampling


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    # Partial rollout / migration: tokens already generated elsewhere, resumed from here.
    resume_ids: list[int] = field(default_factory=list)
    resume_logprobs: list[float] = field(default_factory=list)
    resume_versions: list[int] = field(default_factory=list)
    # The experts the prompt and resumed tokens were routed to where they were generated
    # (`rollout.routing_replay`): kept, not recorded again, so every token keeps the routing
    # its log-prob came from. None: not recorded.
    resume_experts: RoutedExperts | None = None
    # The policy version that must generate it (C1), or None for whatever is loaded. Equal to
    # the hosted version: joins at once; newer: waits for running requests to drain, then runs
    # on the newest staged weights; older: refused (those weights are gone). Ignored with
    # partial rollout, where every token records its own version anyway.
    version: int | None = None
    # Lengths (generated tokens, resumed ones included) at which the engine reports progress
    # while the request runs: the bucket router's milestones. An engine that cannot report
    # simply never does (the request then stays where it started).
    report_at: tuple[int, ...] = ()
    # Scheduling priority, lower first (ties in arrival order): the rollout gives each group
    # its dispatch order, so an engine that is full admits (and keeps, when it must preempt)
    # the older groups the trainer will wait for first. An engine without priority scheduling
    # serves in arrival order.
    priority: int = 0
    # What it is for: "train" (a training sample) or "eval" (held-out evaluation). Engines
    # treat both alike; a trace draws evaluation as its own span.
    purpose: str = "train"


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the sampling distribution (after temperature)
    versions: list[int]  # policy version that generated each token
    # "stop" | "length": done; "abort": stopped on request, partial output kept; "refused": never
    # started because the version it needs is gone from this engine (output = what it came with);
    # "progress": not an end, a note that the request reached a `report_at` length (the output
    # so far, copied); its end comes later
    finish_reason: FinishReason
    # Which tokens are trained: 1 generated, 0 appended by an environment between turns (their
    # log-probs are placeholders). None: every token is generated (single-turn).
    loss_mask: list[int] | None = None
    # `rollout.routing_replay`: the experts of every input token, prompt then response
    # (RoutedExperts); None: not recorded (a dense model, or replay off)
    routed_experts: RoutedExperts | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def final(self) -> bool:
        """The request's last result (every reason but "progress")."""
        return self.finish_reason != "progress"


@dataclass(slots=True)
class EngineStats:
    running: int
    waiting: int
    version: int
    tokens_generated: int
    busy_seconds: float  # time spent generating, for tokens/s and idle ratio
    kv_cache_usage: float = 0.0  # fraction of the KV budget in use, where the engine knows it
    staged_version: int | None = None  # received weights waiting for running requests to end
    sleeping: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.busy_seconds if self.busy_seconds > 0 else 0.0


# ---- trajectories and groups: a prompt's G responses, their rewards --------------------

@dataclass(slots=True)
class Trajectory:
    result: GenerationResult
    reward: float = 0.0
    reward_error: str | None = None  # set when the reward function failed on this sample
    # each of `data.rewards`' value by name, unweighted (`reward` is their weighted sum);
    # None: the run has one reward function
    reward_parts: dict[str, float] | None = None

    @property
    def num_tokens(self) -> int:
        """The response's tokens, environment tokens of a multi-turn episode included."""
        return len(self.result.token_ids)

    @property
    def num_generated(self) -> int:
        """The tokens the policy generated (the trained ones)."""
        mask = self.result.loss_mask
        return self.num_tokens if mask is None else sum(mask)


@dataclass(slots=True)
class Group:
    """One prompt and its responses; trained, replayed and accounted for as a whole."""

    group_id: str
    prompt: str
    answer: str
    prompt_ids: list[int]
    dispatch_version: int
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def is_informative(self) -> bool:
        """Whether GRPO learns anything from it: rewards that are not all equal."""
        rewards = self.rewards
        return len(rewards) > 1 and max(rewards) > min(rewards)


# ---- tool returns, as Libra's router summarises them -------------------------------------

PAYLOAD_SIZES = ("small", "medium", "large")
TOOL_STATUSES = ("success", "failure", "timeout")


@dataclass(frozen=True, slots=True)
class ToolState:
    """What one tool return told us about a request."""

    tool: str
    size: str  # small | medium | large
    status: str  # success | failure | timeout

    def __post_init__(self) -> None:
        if self.size not in PAYLOAD_SIZES:
            raise ValueError(f"tool payload size {self.size!r} is not one of {PAYLOAD_SIZES}")
        if self.status not in TOOL_STATUSES:
            raise ValueError(f"tool status {self.status!r} is not one of {TOOL_STATUSES}")

    @classmethod
    def from_return(cls, tool: str, payload_bytes: int, status: str,
                    thresholds: Sequence[int]) -> ToolState:
        """Classify a payload of `payload_bytes`: small below thresholds[0], large from
        thresholds[1] on (`RoutingConfig.payload_bytes`)."""
        if payload_bytes < 0:
            raise ValueError(f"tool payload of {payload_bytes} bytes is negative")
        size = PAYLOAD_SIZES[sum(payload_bytes >= t for t in thresholds)]
        return cls(tool, size, status)


# ---- the tensors a training step consumes --------------------------------------------------
# Layout: one row per trajectory, prompt then response, right-padded to a common length L.
# Per-position tensors are aligned with `input_ids`: `logprobs[b, t]` is log p(input_ids[b, t] |
# input_ids[b, :t]), so position 0 never carries a value. `loss_mask` is 1 exactly on the response
# tokens that are trained (generated tokens; tool outputs and padding are 0).


@dataclass(slots=True)
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long/bool, 1 on real tokens
    loss_mask: torch.Tensor  # [B, L] float, 1 on trained response tokens
    old_logprobs: torch.Tensor  # [B, L] float, behaviour-policy log-probs (0 off the mask)
    advantages: torch.Tensor  # [B, L] float, per-token advantages (0 off the mask)
    sample_weights: torch.Tensor  # [B] float, e.g. 1 fresh, tau replayed
    versions: torch.Tensor  # [B, L] long, policy version of each token (-1 off the mask)
    ref_logprobs: torch.Tensor | None = None  # [B, L] for the KL term, when enabled
    # [B, L] the proximal policy's log-probs (the trainer's weights at the start of this
    # optimizer step, before any update); given, the loss is decoupled PPO (core/losses.py)
    prox_logprobs: torch.Tensor | None = None
    # [B] long, the prompt's length in each row: rows of one prompt share its forward pass
    # (engines/training/packing.py); None: unknown, every row runs on its own
    prompt_lengths: torch.Tensor | None = None
    # [B, L, layers, top_k] int8/int16, the experts the rollout routed each input token to
    # (aligned with input_ids), -1 where unknown: the trainer replays them
    # (engines/training/routing_replay.py); None: no replay
    routed_experts: torch.Tensor | None = None
    # [B] float in (0, 1]: the stability governor's scale of the off-policy correction's
    # bounds in log-ratio space (each bound b applied as b ** scale: 1 the configured
    # bounds, smaller ones narrower, core/losses.py); None: the configured bounds
    correction_scale: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device) -> "TrainBatch":
        return TrainBatch(**{f.name: (None if getattr(self, f.name) is None
                                      else getattr(self, f.name).to(device))
                             for f in fields(self)})

    def select(self, rows: slice | torch.Tensor | list[int]) -> "TrainBatch":
        return TrainBatch(**{f.name: (None if getattr(self, f.name) is None
                                      else getattr(self, f.name)[rows])
                             for f in fields(self)})

    def select_columns(self, width: int) -> "TrainBatch":
        """The first `width` positions of every per-position tensor (drops trailing padding)."""
        return TrainBatch(**{f.name: _trim(getattr(self, f.name), width) for f in fields(self)})


def _trim(value: torch.Tensor | None, width: int) -> torch.Tensor | None:
    if value is None or value.dim() < 2:
        return value
    return value[:, :width]

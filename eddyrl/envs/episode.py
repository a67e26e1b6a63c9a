"""One multi-turn episode driven token-in/token-out: the loop the rollout runs per sample.

The response side of an episode is a `Transcript`: every token after the prompt, the model's
and the environment's, each with its log-prob, the policy version it belongs to and its loss
mask (1: generated, trained on; 0: environment, masked). The next turn is generated with the
transcript as `resume_ids` (its log-probs and versions as `resume_logprobs` and
`resume_versions`), so the training sequence is exactly what the engine saw, turn after turn:
nothing is ever decoded and encoded again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .base import Action, EnvStats, Environment, Observation, ToolInfo

OBSERVATION_LOGPROB = 0.0  # placeholder for environment tokens; masked, never trained on


@dataclass(frozen=True, slots=True)
class Turn:
    """One model turn as the engine returned it: only its new tokens."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (a stop token: end of message or of a tool call) | "length"


@dataclass
class Transcript:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # model turns [start, end)
    tools: list[ToolInfo] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_turn(self, turn: Turn) -> None:
        if not len(turn.token_ids) == len(turn.logprobs) == len(turn.versions):
            raise ValueError(f"turn of {len(turn.token_ids)} tokens has "
                             f"{len(turn.logprobs)} log-probs and {len(turn.versions)} versions")
        start = len(self.token_ids)
        self.token_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.loss_mask += [1] * len(turn.token_ids)
        self.turn_spans.append((start, len(self.token_ids)))

    def add_observation(self, token_ids: tuple[int, ...] | list[int]) -> None:
        """Environment tokens, masked, tagged with the version of the turn they answer (the
        version that will read them when it generates the next turn, unless weights change)."""
        version = self.versions[-1] if self.versions else 0
        self.token_ids += token_ids
        self.logprobs += [OBSERVATION_LOGPROB] * len(token_ids)
        self.versions += [version] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)


@dataclass(frozen=True, slots=True)
class Episode:
    transcript: Transcript
    reward: float | None  # None: the environment left scoring to the caller
    ended_by: str  # an ENDED_BY reason, or "max_tokens" (the token budget ran out)
    final_text: str  # the last turn's text: what a caller-side reward scores
    error: str | None = None


@dataclass
class EpisodeState:
    """The episode's bookkeeping between the engine and the environment, with no I/O: the
    streaming rollout, which receives turns as engine results, calls `act` and `observe`
    around its own `env.step`; `run_episode` is the same two calls in a plain loop.

    `max_tokens` bounds the whole transcript (the engine's max_new_tokens when turns resume:
    it counts resumed tokens): a turn that ends by length is the last, and an observation that
    would leave no room for another turn ends the episode ("max_tokens", `cutoff_reward`)."""

    decode: Callable[[list[int]], str]
    max_tokens: int
    cutoff_reward: float = 0.0
    stats: EnvStats | None = None
    transcript: Transcript = field(default_factory=Transcript)
    _last_text: str = ""

    def act(self, turn: Turn) -> Action:
        """Append the model's turn; the Action to give `env.step`."""
        self.transcript.add_turn(turn)
        self._last_text = self.decode(turn.token_ids)  # the one decode, for parsing only
        out_of_room = turn.finish_reason != "stop" or len(self.transcript) >= self.max_tokens
        return Action(tuple(turn.token_ids), self._last_text, out_of_room)

    def observe(self, observation: Observation) -> Episode | None:
        """Record the environment's answer: the finished Episode, or None when the model takes
        the next turn (the observation's tokens are then in the transcript, to resume from)."""
        if self.stats is not None:
            self.stats.record(observation)
        if observation.tool is not None:
            self.transcript.tools.append(observation.tool)
        if observation.done:
            return Episode(self.transcript, observation.reward, observation.ended_by,
                           self._last_text, observation.error)
        if len(self.transcript) + len(observation.token_ids) >= self.max_tokens:
            if self.stats is not None:
                self.stats.ended("max_tokens")
            return Episode(self.transcript, self.cutoff_reward, "max_tokens", self._last_text)
        self.transcript.add_observation(observation.token_ids)
        return None


GenerateTurn = Callable[[Transcript], Awaitable[Turn]]


async def run_episode(env: Environment, generate_turn: GenerateTurn,
                      decode: Callable[[list[int]], str], max_tokens: int, *,
                      stats: EnvStats | None = None,
                      on_observation: Callable[[Observation, int], None] | None = None
                      ) -> Episode:
    """Alternate `generate_turn(transcript)` and `env.step` until the episode ends, then
    close the environment. `generate_turn` returns a complete turn (it hides aborts and
    migrations). `on_observation(obs, tokens_so_far)`, called before the observation's tokens
    are appended, is where the bucket router learns of tool returns. Environment failures end
    the episode cleanly (see `Environment.step`); failures of `generate_turn` propagate."""
    state = EpisodeState(decode, max_tokens, env.limits.cutoff_reward, stats)
    try:
        while True:
            action = state.act(await generate_turn(state.transcript))
            observation = await env.step(action)
            if on_observation is not None:
                on_observation(observation, len(state.transcript))
            episode = state.observe(observation)
            if episode is not None:
                return episode
    finally:
        try:
            await env.close()
        except Exception as exc:  # a leak to log, not a reason to lose the episode
            if stats is not None:
                stats.error(f"close: {type(exc).__name__}: {exc}")

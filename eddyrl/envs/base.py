"""The environment contract for multi-turn episodes, token-in/token-out.

One `Environment` object lives for one episode. The caller (the rollout) generates a turn,
hands the environment that turn's token ids and their decoded text (`Action`), and gets back an
`Observation`: the token ids to append after the turn (the environment tokenises its own text,
alone, with the tokenizer it was given; the caller masks these tokens out of the loss), whether
the episode is over, its reward when the environment knows it, and what the tool did
(`ToolInfo`: what Libra's router learns from).

The model's tokens are never re-tokenised: the training sequence is exactly the generated
tokens followed by the environment's tokens, turn after turn.

A subclass writes one method, `respond(action) -> Reply`, in text. `step` does the rest, the
same way for every environment: turn and token limits, tokenisation, timing, and turning any
exception of `respond` into a recorded error that ends the episode cleanly.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import ConfigError
from ..protocol import TOOL_STATUSES, ToolState
from ..token_bytes import max_token_bytes

DEFAULT_PAYLOAD_BYTES = (1024, 16384)  # RoutingConfig.payload_bytes: medium from, large from
# Why an episode ended (Observation.ended_by).
ENDED_BY = ("env", "max_turns", "last_turn", "max_observation_tokens", "error", "timeout")


@dataclass(frozen=True, slots=True)
class Action:
    """One model turn. `text` is the turn's ids decoded once by the caller, for parsing only."""

    token_ids: tuple[int, ...]
    text: str
    # The caller cannot generate after this turn (its token budget is spent): the episode
    # ends here whatever the turn asks for.
    is_last: bool = False


@dataclass(frozen=True, slots=True)
class Reply:
    """What `respond` decides, in text; `step` makes it an `Observation`."""

    text: str = ""  # appended after the turn (ignored when done: nothing follows)
    done: bool = False
    reward: float | None = None  # when done; None: the caller scores the episode itself
    tool: str | None = None  # the tool that ran this turn, if any
    status: str = "success"  # success | failure | timeout
    error: str | None = None  # why the tool failed, for the log (the model sees `text`)


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """A tool's return as Libra's router sees it (`state()`), plus its cost."""

    tool: str
    status: str  # success | failure | timeout
    payload_bytes: int  # UTF-8 size of the observation text
    size: str  # small | medium | large, by the payload thresholds
    latency_s: float
    error: str | None = None

    def state(self) -> ToolState:
        return ToolState(self.tool, self.size, self.status)


@dataclass(frozen=True, slots=True)
class Observation:
    token_ids: tuple[int, ...] = ()  # to append after the turn, loss mask 0
    done: bool = False
    reward: float | None = None  # set when done, unless the caller is to score it
    tool: ToolInfo | None = None  # None when the turn called no tool
    ended_by: str | None = None  # one of ENDED_BY when done
    error: str | None = None  # the environment itself failed (ended_by "error" / "timeout")


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeLimits:
    max_turns: int = 8  # model turns; the last one gets no observation
    max_observation_tokens: int = 1024  # environment tokens in the whole episode
    step_timeout_s: float = 60.0  # backstop for a hung environment; tools time out sooner
    cutoff_reward: float = 0.0  # reward of an episode cut by a limit or an error

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_observation_tokens", "step_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"config key 'env.{key}' = {getattr(self, key)!r} must be > 0")


class Environment(abc.ABC):
    """One episode. Subclasses implement `respond`; callers use `step` (and `close`)."""

    def __init__(self, *, tokenizer, prompt: str, answer: str,
                 limits: EpisodeLimits = EpisodeLimits(),
                 payload_bytes: Sequence[int] = DEFAULT_PAYLOAD_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.answer = answer
        self.limits = limits
        self.payload_bytes = tuple(payload_bytes)
        self.clock = clock  # a simulator passes its virtual clock
        self.turns = 0
        self.observation_tokens = 0
        self.done = False

    # Strings that end a model turn so that the environment can answer (a tool call's closing
    # tag). The caller stops generation on them (`stop_conditions`).
    stop_strings: tuple[str, ...] = ()
    # max_token_bytes of the tokenizer, read once an observation is long (a class default, so
    # that a subclass's own __init__ need not set it)
    _token_bytes: int | None = None

    @abc.abstractmethod
    async def respond(self, action: Action) -> Reply:
        """React to one model turn: run its tool call, or end the episode with a reward."""

    async def close(self) -> None:
        """Release what the episode holds (sandboxes, connections). Called once, at the end."""

    async def step(self, action: Action) -> Observation:
        """The observation after `action`. Never raises for a failure inside the environment
        (an exception, SystemExit included): the episode ends with `ended_by` "error" (or
        "timeout") and `error` set. A KeyboardInterrupt or a cancellation goes on up."""
        if self.done:
            raise RuntimeError("step() called on an episode that has ended")
        self.turns += 1
        start = self.clock()
        try:
            reply = await asyncio.wait_for(_no_exit(self.respond(action)),
                                           self.limits.step_timeout_s)
            _check_reply(reply)
            tool = self._tool_info(reply, self.clock() - start)
            ids = () if reply.done else self._observation_ids(reply.text)
        except asyncio.TimeoutError:
            return self._end("timeout", error=f"environment step took longer than "
                             f"env.step_timeout_s={self.limits.step_timeout_s}s")
        except _Exited as exc:
            return self._end("error", error=str(exc))
        except Exception as exc:  # an environment's bug costs its episode, never the run
            return self._end("error", error=f"{type(exc).__name__}: {exc}")
        if reply.done:
            return self._end("env", reward=reply.reward, tool=tool)
        if self.turns >= self.limits.max_turns:
            return self._end("max_turns", tool=tool)
        if action.is_last:
            return self._end("last_turn", tool=tool)
        if ids is None or \
                self.observation_tokens + len(ids) > self.limits.max_observation_tokens:
            return self._end("max_observation_tokens", tool=tool)
        self.observation_tokens += len(ids)
        return Observation(token_ids=ids, tool=tool)

    def _observation_ids(self, text: str) -> tuple[int, ...] | None:
        """`text`'s token ids, or None when it cannot fit in the episode's observation tokens
        left, told from its bytes without tokenizing it: a token stands for at most
        `max_token_bytes` bytes of text (its longest vocabulary entry: byte-level BPE and
        sentencepiece spellings only overstate it), so `room` tokens cover at most room x
        that many bytes, and a longer text has more tokens than `room`: the same end as
        tokenizing it whole and counting (which took gigabytes for a megabyte), for every
        tokenizer that does not shrink text before it splits it (a normalizer that collapses
        runs of spaces would; prompts assume the same). The tokenizer is never given more than
        that bound."""
        room = self.limits.max_observation_tokens - self.observation_tokens
        if len(text) > room:  # else at most `room` characters: tokenized as they are
            size = len(text.encode("utf-8", errors="replace"))
            if self._token_bytes is None:
                self._token_bytes = max_token_bytes(self.tokenizer)
            if size > room * self._token_bytes:
                return None
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def stop_conditions(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """What ends a model turn, for an engine's sampling parameters: each stop string that
        the tokenizer makes one token as that token's id (the cheap check), the others as
        strings, which every engine matches on the text it generates."""
        ids, strings = [], []
        for text in self.stop_strings:
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == 1:
                ids.append(encoded[0])
            else:
                strings.append(text)
        return tuple(ids), tuple(strings)

    def _tool_info(self, reply: Reply, latency_s: float) -> ToolInfo | None:
        if reply.tool is None:
            return None
        payload = len(reply.text.encode("utf-8"))
        size = ToolState.from_return(reply.tool, payload, reply.status, self.payload_bytes).size
        return ToolInfo(reply.tool, reply.status, payload, size, latency_s, reply.error)

    def _end(self, ended_by: str, *, reward: float | None = None, tool: ToolInfo | None = None,
             error: str | None = None) -> Observation:
        self.done = True
        if ended_by != "env":
            reward = self.limits.cutoff_reward
        return Observation(done=True, reward=reward, tool=tool, ended_by=ended_by, error=error)


class _Exited(Exception):
    """`respond()` raised SystemExit, carried out of `wait_for`'s task as an ordinary
    exception: a SystemExit escaping a task ends the event loop, and the run with it."""


async def _no_exit(respond):
    try:
        return await respond
    except SystemExit as exc:
        raise _Exited(f"SystemExit: {exc}") from None


def _check_reply(reply: object) -> None:
    if not isinstance(reply, Reply):
        raise TypeError(f"respond() returned {type(reply).__name__}, not a Reply")
    if reply.status not in TOOL_STATUSES:
        raise ValueError(f"Reply.status {reply.status!r} is not one of {TOOL_STATUSES}")


@dataclass
class EnvStats:
    """Counts over many episodes for the metrics log: turns, tool calls by tool and status,
    episode endings, episodes started over (their turns lost) by why, and the last few
    environment errors."""

    turns: int = 0
    episodes: int = 0
    tool_calls: Counter = field(default_factory=Counter)  # (tool, status) -> calls
    ended_by: Counter = field(default_factory=Counter)
    errors: int = 0
    last_errors: list[str] = field(default_factory=list)
    tool_seconds: float = 0.0
    restarts: Counter = field(default_factory=Counter)  # why -> episodes started over

    def record(self, observation: Observation) -> None:
        self.turns += 1
        if observation.tool is not None:
            self.tool_calls[observation.tool.tool, observation.tool.status] += 1
            self.tool_seconds += observation.tool.latency_s
        if observation.done:
            self.ended(observation.ended_by)
        if observation.error is not None:
            self.error(observation.error)

    def ended(self, reason: str) -> None:
        self.episodes += 1
        self.ended_by[reason] += 1

    def restarted(self, reason: str) -> None:
        self.restarts[reason] += 1

    def error(self, message: str) -> None:
        self.errors += 1
        self.last_errors = (self.last_errors + [message])[-5:]

    def metrics(self, prefix: str = "env/") -> dict[str, float]:
        out = {f"{prefix}turns": float(self.turns), f"{prefix}episodes": float(self.episodes),
               f"{prefix}errors": float(self.errors), f"{prefix}tool_seconds": self.tool_seconds,
               f"{prefix}restarted_episodes": float(sum(self.restarts.values()))}
        for (tool, status), count in sorted(self.tool_calls.items()):
            out[f"{prefix}calls/{tool}/{status}"] = float(count)
        for reason, count in sorted(self.ended_by.items()):
            out[f"{prefix}ended_by/{reason}"] = float(count)
        for reason, count in sorted(self.restarts.items()):
            out[f"{prefix}restarted_by/{reason}"] = float(count)
        return out

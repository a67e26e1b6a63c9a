"""An environment with one tool, the shape most agentic math tasks take: while the model's turn
ends in a tool call, run the tool and answer with its result; a turn with no call is the final
answer, and the episode's reward is the task's reward of that turn's text.

The tags are a `ToolSyntax`, so one class serves a chat model (`<calc>`...`</calc>` answered by
`<result>`...`</result>`, or a template's tool-response block) and the tiny character model,
whose vocabulary has no `<` or `/`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from ..plugins import load_reward_fn
from .base import Action, Environment, Reply

RewardFn = Callable[[str, str], float]
DEFAULT_REWARD = "eddyrl.tasks.reward:reward"


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    call_open: str
    call_close: str  # also the stop string that ends the model's turn
    result_open: str
    result_close: str

    def find_call(self, text: str) -> str | None:
        """The argument of the turn's last complete call, or None when it makes none."""
        end = text.rfind(self.call_close)
        if end < 0:
            return None
        start = text.rfind(self.call_open, 0, end)
        return None if start < 0 else text[start + len(self.call_open):end]

    def result(self, body: str) -> str:
        return f"{self.result_open}{body}{self.result_close}"


@dataclass(frozen=True, slots=True)
class ToolResult:
    status: str  # success | failure | timeout
    output: str  # what the model is shown
    error: str | None = None  # for the log


class ToolEnv(Environment):
    """Subclasses name the tool (`tool_name`), their syntaxes by name (the first is the
    default; a config picks one by name), and implement `run_tool`."""

    tool_name: str = "tool"
    syntaxes: dict[str, ToolSyntax]

    def __init__(self, *, syntax: ToolSyntax | str | None = None,
                 reward_fn: RewardFn | str = DEFAULT_REWARD, **base) -> None:
        super().__init__(**base)
        if isinstance(syntax, str) and syntax not in self.syntaxes:
            raise ConfigError(f"config key 'env.options.syntax' = {syntax!r} is not a "
                              f"{self.tool_name} syntax; choose one of "
                              f"{', '.join(map(repr, self.syntaxes))}")
        self.syntax = self.syntaxes[syntax] if isinstance(syntax, str) else \
            syntax or next(iter(self.syntaxes.values()))
        # a config gives a dotted path; validated once per episode, then cached by the import
        self.reward_fn = load_reward_fn(reward_fn, "env.options.reward_fn") \
            if isinstance(reward_fn, str) else reward_fn
        self.stop_strings = (self.syntax.call_close,)

    @abc.abstractmethod
    async def run_tool(self, argument: str) -> ToolResult:
        """Run one call; failures are results (status failure / timeout), not exceptions."""

    async def respond(self, action: Action) -> Reply:
        argument = self.syntax.find_call(action.text)
        if argument is None:
            return Reply(done=True, reward=float(self.reward_fn(action.text, self.answer)))
        result = await self.run_tool(argument)
        return Reply(text=self.syntax.result(result.output), tool=self.tool_name,
                     status=result.status, error=result.error)

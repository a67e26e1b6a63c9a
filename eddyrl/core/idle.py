"""A run that cannot learn stops and says why (`loop.max_idle_steps`).

GRPO learns from a group only when its rewards differ: a reward that always returns the same
value (a wrong answer format, a `max_new_tokens` that cuts every answer off, a reward function
that fails on every sample) gives steps that train no sample, and a run of them is the most
expensive mistake a user can make on a cluster: it used to go on to the last step and report
success. `IdleWatch` counts the steps in a row that trained no sample; after `limit` of them
the controller stops the run with `message()`: three sampled responses with their answers and
rewards, the share of groups whose rewards were all equal, the reward function (each of
`data.rewards` with its weight, and each sample's reward from each), and the likely causes.
Before training, `check_initial` warns when every held-out reward of the warm start is the
same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..protocol import Group
from .rewarding import WeightedRewards

log = logging.getLogger(__name__)

SHOWN = 3  # sampled responses in the message
TEXT_CHARS = 160  # of each response and answer shown


@dataclass
class IdleWatch:
    """Steps in a row that trained no sample, and what those steps generated."""

    limit: int  # loop.max_idle_steps; 0: never stop
    decode: Callable[[list[int]], str]
    reward_name: str  # the reward function, as the message names it
    idle: int = 0
    generated: int = 0  # groups generated during the idle steps
    equal: int = 0  # of them, groups whose rewards were all equal
    # the last responses seen (token ids: decoded only if the message is shown), their
    # answers, rewards, reward errors and each named reward's value (data.rewards)
    examples: list[tuple[list[int], str, float, str | None, dict[str, float] | None]] = \
        field(default_factory=list)

    def saw(self, groups: Sequence[Group]) -> None:
        """A step's generated groups (kept or dropped)."""
        self.generated += len(groups)
        self.equal += sum(not g.is_informative() for g in groups)
        last = [g for g in groups if g.trajectories][-SHOWN:]
        self.examples = (self.examples + [
            (t.result.token_ids, g.answer, t.reward, t.reward_error, t.reward_parts)
            for g in last for t in g.trajectories[:1]])[-SHOWN:]

    def stepped(self, samples_trained: int) -> bool:
        """After a step: True when the run should stop (the limit reached)."""
        if samples_trained:
            self.idle = self.generated = self.equal = 0
            return False
        self.idle += 1
        return bool(self.limit) and self.idle >= self.limit

    def check_initial(self, groups: Sequence[Group]) -> None:
        """Warn when every held-out reward of the starting model is the same."""
        trajectories = [(g, t) for g in groups for t in g.trajectories]
        warning = check_initial([t.reward for _, t in trajectories],
                                [(self.decode(t.result.token_ids), g.answer, t.reward)
                                 for g, t in trajectories], self.reward_name)
        if warning:
            log.warning(warning)

    def message(self) -> str:
        share = self.equal / self.generated if self.generated else 1.0
        lines = [f"stopped: no sample was trained in the last {self.idle} steps "
                 f"(loop.max_idle_steps={self.limit}); {share:.0%} of the {self.generated} "
                 f"groups generated had all rewards equal, so every advantage was 0. "
                 f"Reward function: {self.reward_name}. Sampled responses:"]
        for ids, answer, reward, error, parts in self.examples:
            response = self.decode(ids)
            scored = f"reward {reward:g}" + (f" ({_parts(parts)})" if parts else "") + \
                (f" (error: {error})" if error else "")
            lines.append(f"  response {_cut(response)!r} | answer {_cut(answer)!r} | {scored}")
        lines.append("Likely causes: the reward returns the same value for every response "
                     "(check it on these), the answer's format is not what the reward "
                     "expects, or rollout.max_new_tokens cuts answers off. Set "
                     "loop.max_idle_steps=0 to train on regardless.")
        return "\n".join(lines)


def check_initial(rewards: Sequence[float], examples: Sequence[tuple[str, str, float]],
                  reward_name: str) -> str | None:
    """A warning when every held-out reward of the starting model is the same (None: they
    differ, or there are too few to tell)."""
    if len(rewards) < 2 or max(rewards) > min(rewards):
        return None
    shown = "; ".join(f"response {_cut(r)!r}, answer {_cut(a)!r}"
                      for r, a, _ in list(examples)[:SHOWN])
    return (f"every held-out response of the starting model got reward {rewards[0]:g} from "
            f"{reward_name}: if the training samples score alike too, nothing will train "
            f"(the run stops after loop.max_idle_steps such steps). E.g. {shown}")


def reward_name(fn: Any) -> str:
    """`module:function`; for several rewards, their sum: `1 * correct (m:f) + 0.2 * ...`."""
    if isinstance(fn, WeightedRewards):
        return " + ".join(f"{t.weight:g} * {t.name} ({reward_name(t.fn)})" for t in fn.terms)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{name}" if module else name


def _parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in parts.items())


def _cut(text: str) -> str:
    text = str(text)
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + "..."

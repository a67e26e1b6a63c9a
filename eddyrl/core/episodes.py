"""Multi-turn episodes inside the streaming rollout: what happens between an engine's turn and
the next one.

A request with an environment is an episode. Each time the engine ends a turn ("stop" on the
end of message or on the environment's stop token, or "length"), the rollout hands the result
to `Episodes.take_turn`: the turn's new tokens (everything after the transcript the request
resumed from) are appended, the environment steps, and either the observation's tokens are
appended (loss mask 0) and the request resumes from the transcript on its worker, or the
episode is over and `result` builds the training sample: the whole transcript with its loss
mask. The engine never sees anything but token ids; nothing is decoded and encoded again.

The bookkeeping is `envs.EpisodeState`, the same object `envs.run_episode` drives in a plain
loop; `Episodes` adds what a long-running rollout needs: the environment is built lazily at
the first turn's end (no environment exists for an episode still in its first turn), any
failure of the environment (construction, step, close, a non-finite reward) ends the episode
with the cutoff reward and is counted, never raised, and statistics are kept apart for
training and evaluation episodes.

The rollout's side of a turn's end (pause the request, place its next turn: C1) is
`core/turns.py`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from ..protocol import GenerationResult
from ..envs.base import EnvStats, Observation
from ..envs.episode import Episode, EpisodeState, Turn
from ..envs.hosting import EnvHost, HostedEnv
from ..envs.loading import EnvironmentFactory
from ..usercode.pool import UserCodeError


@dataclass(slots=True)
class EpisodeRun:
    """One request's episode: its transcript so far and, after its first turn, its
    environment. `stepping` while the environment works on a turn (no engine runs it then)."""

    state: EpisodeState
    env: HostedEnv | None = None
    stepping: bool = False


class _NoStats:
    """The statistics of no episodes: none to report."""

    last_errors: tuple[str, ...] = ()

    def metrics(self, prefix: str = "env/") -> dict[str, float]:
        return {}


class NoEpisodes:
    """Single-turn generation: no environment, no episode, nothing to report. Stands in for
    `Episodes` when the run has no `env` section (eddyrl.build)."""

    stats = eval_stats = _NoStats()

    def start(self, max_tokens: int, training: bool) -> None:
        return None  # a request without an episode is one turn

    def report(self) -> dict[str, Any]:
        return {}


@dataclass
class Episodes:
    """The run's episodes. `factory` builds their environments; given as an `envs.EnvHost`
    (what `eddy train` builds from `user_code.env`) they live in its user-code pool (worker
    threads or processes), given bare they run inline on the caller's loop. Wherever they run,
    any failure of user code (an exception, SystemExit included, a hang past the limit, a dead
    worker, a reward that is not a finite number) ends the episode with the cutoff reward and
    is counted in the episode statistics (`env/errors`, `env/ended_by/<error|timeout>`)."""

    factory: EnvironmentFactory | EnvHost
    decode: Callable[[list[int]], str]  # one decode per turn, for the environment to parse
    stats: EnvStats = field(default_factory=EnvStats)  # training episodes
    eval_stats: EnvStats = field(default_factory=EnvStats)  # held-out evaluation episodes
    host: EnvHost = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.host = self.factory if isinstance(self.factory, EnvHost) else \
            EnvHost(self.factory)

    def report(self) -> dict[str, Any]:
        """For the run summary: the training episodes' counts, the last errors, evaluation's
        (and, off the loop, the pool's replaced workers)."""
        return {**self.stats.metrics(""), "last_errors": self.stats.last_errors,
                "eval": self.eval_stats.metrics(""), **self.host.report()}

    def start(self, max_tokens: int, training: bool) -> EpisodeRun:
        """A new episode whose transcript may reach `max_tokens` (the request's
        max_new_tokens: engines count resumed tokens against it), counted in `stats`
        (training) or `eval_stats`."""
        # the configured cutoff from the start: an environment that fails to build has none
        return EpisodeRun(EpisodeState(self.decode, max_tokens,
                                       self.host.limits.cutoff_reward,
                                       stats=self.stats if training else self.eval_stats))

    def restart(self, run: EpisodeRun, reason: str) -> EpisodeRun:
        """A fresh episode in place of `run` (close `run` separately), counted alike; the
        restart is counted by `reason`."""
        state = run.state
        if state.stats is not None:
            state.stats.restarted(reason)
        return EpisodeRun(EpisodeState(self.decode, state.max_tokens, state.cutoff_reward,
                                       stats=state.stats))

    async def take_turn(self, run: EpisodeRun, result: GenerationResult, prompt: str,
                        answer: str) -> tuple[Observation, Episode | None]:
        """Append the turn `result` ends and step the environment: the observation, and the
        finished Episode (its environment closed) or None when the model takes the next turn
        (resume from `run.state.transcript`)."""
        state = run.state
        start = len(state.transcript)
        if list(result.token_ids[:start]) != state.transcript.token_ids:
            raise RuntimeError(f"request {result.request_id}: the engine returned a transcript "
                               "that differs from the one it resumed from")
        action = state.act(Turn(list(result.token_ids[start:]), list(result.logprobs[start:]),
                                list(result.versions[start:]), result.finish_reason))
        try:
            if run.env is None:
                run.env = self.host.open()
                state.cutoff_reward = await run.env.build(prompt, answer)
            observation = _checked(await run.env.step(action), state.cutoff_reward)
        except UserCodeError as exc:  # the environment's failure costs its episode, not the run
            observation = Observation(done=True, reward=state.cutoff_reward,
                                      ended_by="timeout" if exc.reason == "timeout" else "error",
                                      error=exc.message)
        episode = state.observe(observation)
        if episode is not None:
            await self.close(run)
        return observation, episode

    def result(self, run: EpisodeRun, last: GenerationResult) -> GenerationResult:
        """The transcript as one result: what is stored, scored and trained (or resumed)."""
        t = run.state.transcript
        return GenerationResult(last.request_id, list(last.prompt_ids), list(t.token_ids),
                                list(t.logprobs), list(t.versions), last.finish_reason,
                                loss_mask=list(t.loss_mask),
                                # the last turn's request saw the whole transcript as its prompt
                                routed_experts=last.routed_experts)

    async def close(self, run: EpisodeRun) -> None:
        """Release the environment (an episode ended, or is restarted from scratch)."""
        env, run.env = run.env, None
        if env is None:
            return
        try:
            await env.close()
        except UserCodeError as exc:  # a leak to log, not a reason to lose the episode
            if run.state.stats is not None:
                run.state.stats.error(f"close: {exc.message}")


def _checked(observation: Any, cutoff_reward: float) -> Observation:
    """`observation` if it is one, with a reward that is None or a finite number; else the
    end of the episode with the cutoff reward, as an environment error."""
    problem = None
    if not isinstance(observation, Observation):
        problem = f"environment step returned {type(observation).__name__}, not an Observation"
    elif observation.done and observation.reward is not None:
        reward = observation.reward
        if not isinstance(reward, numbers.Real):
            problem = f"environment reward {reward!r} is not a number"
        elif not math.isfinite(reward):
            problem = f"environment reward {reward}"
    if problem is None:
        return observation
    tool = observation.tool if isinstance(observation, Observation) else None
    return Observation(done=True, reward=cutoff_reward, ended_by="error", tool=tool,
                       error=problem)

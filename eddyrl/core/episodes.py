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

`EpisodeTurns` is the rollout's side (a mixin of `StreamingRollout`): a turn's end pauses the
request on its worker (`VersionAssignment.paused`: still its version's live work, but not
running in the engine), the environment steps in a task of its own, and the next turn goes
where the episode's version is hosted (C1): its worker, or, if that worker took new weights
meanwhile, another host of the version, moved like a migration; only when no worker hosts it
any more does the episode start over, counted in `env/restarted_episodes` with why. With
partial rollout the next turn simply runs on the newest weights (per-token versions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..protocol import GenerationResult, SamplingParams
from ..envs.base import EnvStats, Environment, Observation
from ..envs.episode import Episode, EpisodeState, Turn
from ..envs.loading import EnvironmentFactory

if TYPE_CHECKING:
    from ..scheduler.buckets import BucketRouter
    from .version_assignment import VersionAssignment
    from .rewarding import SafeReward
    from .rollout import _Request


@dataclass(slots=True)
class EpisodeRun:
    """One request's episode: its transcript so far and, after its first turn, its
    environment. `stepping` while the environment works on a turn (no engine runs it then)."""

    state: EpisodeState
    env: Environment | None = None
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
    factory: EnvironmentFactory
    decode: Callable[[list[int]], str]  # one decode per turn, for the environment to parse
    stats: EnvStats = field(default_factory=EnvStats)  # training episodes
    eval_stats: EnvStats = field(default_factory=EnvStats)  # held-out evaluation episodes

    def report(self) -> dict[str, Any]:
        """For the run summary: the training episodes' counts, the last errors, evaluation's."""
        return {**self.stats.metrics(""), "last_errors": self.stats.last_errors,
                "eval": self.eval_stats.metrics("")}

    def start(self, max_tokens: int, training: bool) -> EpisodeRun:
        """A new episode whose transcript may reach `max_tokens` (the request's
        max_new_tokens: engines count resumed tokens against it), counted in `stats`
        (training) or `eval_stats`."""
        # the configured cutoff from the start: an environment that fails to build has none
        limits = getattr(self.factory, "kwargs", {}).get("limits")
        return EpisodeRun(EpisodeState(self.decode, max_tokens,
                                       getattr(limits, "cutoff_reward", 0.0),
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
                run.env = self.factory(prompt=prompt, answer=answer)
                state.cutoff_reward = run.env.limits.cutoff_reward
            observation = await run.env.step(action)
        except Exception as exc:  # a custom environment's bug costs its episode, not the run
            observation = Observation(done=True, reward=state.cutoff_reward, ended_by="error",
                                      error=f"{type(exc).__name__}: {exc}")
        if observation.done and observation.reward is not None and \
                not math.isfinite(observation.reward):
            observation = Observation(done=True, reward=state.cutoff_reward, ended_by="error",
                                      tool=observation.tool,
                                      error=f"environment reward {observation.reward}")
        episode = state.observe(observation)
        if episode is not None:
            await self.close(run)
        return observation, episode

    def result(self, run: EpisodeRun, last: GenerationResult) -> GenerationResult:
        """The transcript as one result: what is stored, scored and trained (or resumed)."""
        t = run.state.transcript
        return GenerationResult(last.request_id, list(last.prompt_ids), list(t.token_ids),
                                list(t.logprobs), list(t.versions), last.finish_reason,
                                loss_mask=list(t.loss_mask))

    async def close(self, run: EpisodeRun) -> None:
        """Release the environment (an episode ended, or is restarted from scratch)."""
        env, run.env = run.env, None
        if env is None:
            return
        try:
            await env.close()
        except Exception as exc:  # a leak to log, not a reason to lose the episode
            if run.state.stats is not None:
                run.state.stats.error(f"close: {type(exc).__name__}: {exc}")


class EpisodeTurns:
    """What `StreamingRollout` does at an episode's turn ends. A mixin: the state is the
    rollout's; `_finish`, `_fail`, `_track` and the migration half's `_queue_resume`,
    `_move_between_turns`, `_restart` and `_allowed_targets` do the rest."""

    episodes: Episodes | NoEpisodes
    assignment: VersionAssignment
    router: BucketRouter | None
    reward: SafeReward
    partial_rollout: bool
    routed: int

    def _new_episode(self, sampling: SamplingParams, training: bool) -> EpisodeRun | None:
        """An episode for a new request (None: single-turn); `training` picks the statistics
        it counts in (held-out evaluation has its own)."""
        return self.episodes.start(sampling.max_new_tokens, training)

    def _turn_ended(self, request_id: str, request: _Request, result: GenerationResult) -> None:
        """The engine ended one of the episode's turns: it waits for its environment, still
        counted on its worker, while the environment steps off this call."""
        request.episode.stepping = True
        self.assignment.paused(request.worker, request.version)
        self._track(self._take_turn(request_id, request, result))

    async def _take_turn(self, request_id: str, request: _Request,
                         result: GenerationResult) -> None:
        """Step the episode's environment on the turn `result` ends, then resume the request
        from the transcript where its version is hosted, or finish it."""
        try:
            run = request.episode
            observation, episode = await self.episodes.take_turn(
                run, result, request.group.prompt, request.group.answer)
            run.stepping = False
            self.assignment.resumed(request.worker, request.version)
            if episode is None:
                tokens = len(run.state.transcript) - len(observation.token_ids)
                self._tool_returned(request_id, request, observation, tokens)
                if self._place_next_turn(request_id, request):
                    self._queue_resume(request, self.episodes.result(run, result))
                return
            final = self.episodes.result(run, result)
            if episode.reward is None:  # the environment left scoring to the task's reward
                reward, error = self.reward(episode.final_text, request.group.answer)
            else:
                reward, error = float(episode.reward), None
            self._finish(request, final, reward, error)
        except BaseException as exc:  # surfaced to whoever waits next
            self._fail(exc)

    def _place_next_turn(self, request_id: str, request: _Request) -> bool:
        """C1 between turns: the next turn stays on its worker if that is still available (not
        lost, not lent to training) and hosts the episode's version (or the version is the
        latest, which the worker switches to); else
        it goes to another host of the version, picked by the assignment as for any request
        of it and moved like a migration. With no host left the episode starts over on the
        latest version (False: nothing to resume)."""
        assignment = self.assignment
        if assignment.available[request.worker] and (self.partial_rollout or request.version
                                                        in (assignment.hosted[request.worker],
                                                            assignment.latest)):
            return True
        if assignment.hosts_now(request.version):
            target = assignment.pick(request.version)
            self._move_between_turns(request, target)
            if self.router is not None:
                self.router.relocate(request_id, target)
            return True
        self._restart(request, request_id, "version_retired")
        return False

    def _tool_returned(self, request_id: str, request: _Request, observation: Observation,
                       tokens: int) -> None:
        """Libra: a tool returned after `tokens` output tokens; the router records the state
        and may send the request's next turn to another bucket (nothing runs: no abort)."""
        if self.router is None or observation.tool is None:
            return
        allowed = self._allowed_targets(request) or [request.worker]  # record, do not move
        move = self.router.on_state(request_id, observation.tool.state(), tokens, allowed)
        if move is None:
            return
        self._move_between_turns(request, move.target.instance)
        self.routed += 1

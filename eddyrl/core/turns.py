"""What the rollout does at a multi-turn episode's turn ends (`core/episodes.py` is the
environment's side: transcripts, stepping, statistics).

A turn's end pauses the request on its worker (BETWEEN_TURNS: still its version's live work,
not running in the engine), the environment steps in a task of its own, and the next turn goes
where the episode's version is hosted (C1): its worker, or, if that worker took new weights or
left meanwhile, another host of the version (a move); only when no worker hosts it any more
does the episode start over, counted in `env/restarted_episodes` with why. With partial
rollout the next turn simply runs on the newest weights (per-token versions). A tool's return
is a state for Libra's router, which may send the next turn to another bucket.
"""

from __future__ import annotations

from typing import Any, Callable

from ..envs.base import Observation
from ..protocol import GenerationResult
from .moves import Moves
from .requests import Request
from .streams import Streams


class Turns:
    def __init__(self, moves: Moves, streams: Streams, episodes: Any,
                 finish: Callable[[Request, GenerationResult, float | None], None]) -> None:
        self.moves = moves
        self.assignment = moves.assignment
        self.table = moves.table
        self.streams = streams
        self.episodes = episodes
        self.finish = finish  # the collector: score (or take the episode's reward) and store

    def turn_ended(self, request: Request, result: GenerationResult) -> None:
        """The engine ended one of the episode's turns: it waits for its environment, still
        counted on its worker, while the environment steps off this call."""
        self.table.pause(request.id)
        self.streams.track(self.streams.guarded(self._take_turn(request, result)))

    async def _take_turn(self, request: Request, result: GenerationResult) -> None:
        """Step the episode's environment on the turn `result` ends, then resume the request
        from the transcript where its version is hosted, or finish it."""
        run = request.episode
        observation, episode = await self.episodes.take_turn(
            run, result, request.group.prompt, request.group.answer)
        if episode is not None:
            reward = None if episode.reward is None else float(episode.reward)
            self.finish(request, self.episodes.result(run, result), reward)
            return
        tokens = len(run.state.transcript) - len(observation.token_ids)
        self._tool_returned(request, observation, tokens)
        worker = self._next_turn_worker(request)
        if worker is None:
            self.moves.restart(request, "version_retired")
            return
        self.table.resume(request.id, worker)
        self.streams.send(request, self.episodes.result(run, result))

    def _next_turn_worker(self, request: Request) -> int | None:
        """C1 between turns: the next turn stays on its worker if that is still available (not
        lost, not lent to training) and hosts the episode's version (or the version is the
        latest, which the worker switches to); else it goes to another host of the version.
        None: no host left (the episode starts over on the latest version)."""
        worker, assignment = request.worker, self.assignment
        if assignment.available[worker] and (
                self.moves.partial_rollout
                or request.version in (assignment.hosted[worker], assignment.latest)):
            return worker
        return self.moves.nearest_host(request)

    def _tool_returned(self, request: Request, observation: Observation, tokens: int) -> None:
        """Libra: a tool returned after `tokens` output tokens; the placement records the
        state and may send the request's next turn to another bucket (nothing runs: no
        abort)."""
        if observation.tool is None:
            return
        allowed = self.moves.allowed_targets(request) or [request.worker]  # record only
        target = self.moves.placement.tool_state(request.id, observation.tool.state(), tokens,
                                                 allowed)
        if target is not None and target != request.worker:
            self.table.move_between_turns(request.id, target, "tool_state")

"""What the rollout does at a multi-turn episode's turn ends (`core/episodes.py` is the
environment's side: transcripts, stepping, statistics).

A turn's end pauses the request on its worker (BETWEEN_TURNS: still its version's live work,
not running in the engine), the environment steps in a task of its own, and the next turn goes
where the episode's version is hosted (C1): its worker, or, if that worker took new weights or
left meanwhile, another host of the version (a move); only when no worker hosts it any more
does the episode start over, counted in `env/restarted_episodes` with why. With partial
rollout the next turn simply runs on the newest weights (per-token versions). A tool's return
is a state for Libra's router, which may send the next turn to another bucket. Where the next
turn goes is a move, so `moves.py` decides it (`next_turn_worker`, `tool_returned`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..protocol import GenerationResult
from .moves import Moves
from .requests import Request, RequestTable
from .streams import Streams

if TYPE_CHECKING:  # annotations only: episodes.py brings in the environments
    from .episodes import Episodes, NoEpisodes


class Turns:
    def __init__(self, table: RequestTable, moves: Moves, streams: Streams,
                 episodes: Episodes | NoEpisodes,
                 finish: Callable[[Request, GenerationResult, float | None], None]) -> None:
        self.table = table  # the rollout's
        self.moves = moves  # where the next turn goes (C1, Libra), or its restart
        self.streams = streams
        self.episodes = episodes
        self.finish = finish  # the collector: score (or take the episode's reward) and store

    def turn_ended(self, request: Request, result: GenerationResult) -> None:
        """The engine ended one of the episode's turns: it waits for its environment, still
        counted on its worker, while the environment steps off this call."""
        self.table.pause(request.id)
        self.streams.start_task(self.streams.guarded(self._take_turn(request, result)))

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
        if observation.tool is not None:
            tokens = len(run.state.transcript) - len(observation.token_ids)
            self.moves.tool_returned(request, observation.tool.state(), tokens)
        worker = self.moves.next_turn_worker(request)
        if worker is None:
            self.moves.restart(request, "version_retired")
            return
        self.table.resume(request.id, worker)
        self.streams.send(request, self.episodes.result(run, result))

"""The weight sync from the driver's side: the weight channel between the trainer and the
rollout workers (`cluster.weight_channel`; its transports: hal/weight_channel.py) opened at
start, opened again when a rollout worker is replaced or the trainer's rank 0 is a new actor
(trainer_rebuild.py), and each sync sent through it. Trainer rank 0 sends; each rollout
worker receives with one rank, or with one per process of its engine where the engine takes
the broadcast itself (vLLM's workers).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, Sequence

from ...errors import WorkerLost
from ..workers import weight_group_layout
from .calls import RayCalls
from .rollout_actors import RolloutActors
from .trainer_calls import TrainerCalls


class WeightSync:
    """`rendezvous(name, world_size)`: where a group led by trainer rank 0 meets
    (`RayRuntime._rendezvous`). The trainer's actors are given at each call: a rebuild after
    a lost rank replaces them."""

    def __init__(self, kind: str, calls: RayCalls, actors: RolloutActors,
                 rendezvous: Callable[[str, int], str]) -> None:
        self.kind = kind
        self.calls, self.actors = calls, actors
        self._rendezvous = rendezvous
        self._generation = 0  # a new rendezvous name for each connection
        self._lock = threading.Lock()

    def connect(self, trainers: list[Any]) -> None:
        """Open the weight channel between trainer rank 0 and every rollout worker. A worker
        found dead meanwhile is marked lost (its next call tells the rollout); a collective
        group cannot form without it, so there that is an error. One at a time: a rollout
        worker's replacement and a trainer's rebuild may both reopen it, from their threads."""
        with self._lock:
            self._open(trainers)

    def _open(self, trainers: list[Any]) -> None:
        workers = self.actors.handles
        ranks = self.actors.results_of_each([w.weight_ranks.remote(self.kind) for w in workers],
                                            self.kind, 1)
        offsets, world = weight_group_layout(ranks)
        # a new rendezvous per connection: a replaced worker rebuilds the group for every member
        rendezvous = self._rendezvous(f"weight_channel.{self._generation}", world) \
            if self.kind == "collective" else ""
        self._generation += 1
        senders = [(f"trainer rank {r}", "weight channel set-up",
                    t.connect_weight_channel.remote(self.kind, rendezvous, 0, world))
                   for r, t in enumerate(trainers)]
        self.actors.results_of_each([w.connect_weight_channel.remote(self.kind, rendezvous,
                                                                   offset, world)
                                     for w, offset in zip(workers, offsets)], self.kind, None)
        self.calls.get_all(senders)

    async def send(self, version: int, hold: Sequence[int], trainers: list[Any],
                   ranks: TrainerCalls, before_send: Callable[[], Awaitable[None]] | None
                   ) -> list[int]:
        """The trainer's weights of `version` to every live rollout worker; returns the version
        each now hosts (-1: lost or being replaced). `hold`: workers that stage the weights and
        keep their own; `before_send`: after the ranks' export is ready, before it is sent
        (colocated: the engines' turn on the devices)."""
        specs = await ranks.call_all([(r, "weight export", t.describe_weights.remote())
                                      for r, t in enumerate(trainers)])
        if before_send is not None:  # the export holds the weights in host memory
            await before_send()
        receivers = self.actors.live()
        results = await asyncio.gather(
            ranks.call_all([(r, "weight send", t.send_weights.remote())
                            for r, t in enumerate(trainers)]),
            *(self.actors.call(i, f"weight load v{version}",
                               lambda actor, i=i: actor.load_weights.remote(
                                   version, specs[0], i in hold))
              for i in receivers), return_exceptions=True)
        hosted = [-1] * len(self.actors)
        if isinstance(results[0], BaseException):  # the trainer ranks' sends
            raise results[0]
        for worker, result in zip(receivers, results[1:]):
            if isinstance(result, WorkerLost):
                # dead before anyone noticed: its next call raises WorkerLost to the rollout,
                # which puts its requests back and has it replaced
                self.actors.mark_lost(worker)
            elif isinstance(result, BaseException):
                raise result
            else:
                hosted[worker] = result
        return hosted

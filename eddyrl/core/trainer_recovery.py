"""A trainer call that survives the loss of a trainer rank: the runtime rebuilds the trainer at
the state of its last completed call (a step, or a part of a streamed step:
`train.stream_chunks`), and the call that lost the rank runs again.

The controller makes three kinds of trainer call: a training step, a weight publish, a
checkpoint write. Each goes through `TrainerRecovery.call`. When one raises `TrainerRankLost`
and the runtime is `TrainerRecoverable`, the runtime rebuilds the trainer (a replacement rank,
or the survivors alone: `RayRuntime.recover_trainer`) as it was after the last step that
completed, and the same call runs again with the same arguments (the same batch). The call
returns once, so the version window, the ledger and `metrics.jsonl` see one step, never two
and never none: the interrupted attempt left nothing behind (its state was discarded by the
rebuild), and nothing was committed by the controller before the call returned.

A runtime that cannot rebuild (`train.on_rank_loss = stop`, one rank, no copy of the lost
shard) raises the loss back with the reason (`TrainerRankLost.not_recovered`); so does a call
that keeps losing ranks (`MAX_LOSSES_PER_CALL`): something is failing that a new rank does
not cure.

What the recoveries cost is kept for the step's record (`drain`): how many, how long the
calls were held up by them, the trainer's world after the last.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, TypeVar

from ..runtime_protocol import TrainerRankLost, TrainerRecoverable

T = TypeVar("T")

# A call that loses this many ranks in a row without completing ends the run.
MAX_LOSSES_PER_CALL = 3


class TrainerRecovery:
    def __init__(self, runtime: Any, now: Callable[[], float]) -> None:
        self.runtime = runtime if isinstance(runtime, TrainerRecoverable) else None
        self.now = now
        self.recoveries = 0  # in the whole run
        self.events: list[dict[str, Any]] = []  # each recovery, for the run's summary
        self._pending: dict[str, float] = {}  # this step's, until `drain`

    async def call(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        """`make()` awaited; after a lost rank and the trainer's rebuild, `make()` again."""
        losses = 0
        while True:
            try:
                return await make()
            except TrainerRankLost as lost:
                losses += 1
                if self.runtime is None:
                    raise lost.not_recovered(
                        "this runtime cannot rebuild its trainer in place") from lost
                if losses > MAX_LOSSES_PER_CALL:
                    raise lost.not_recovered(
                        f"{what} lost a trainer rank {losses} times in a row") from lost
                began = self.now()
                metrics = await self.runtime.recover_trainer(lost)
                self._record(what, lost, self.now() - began, metrics)

    def _record(self, what: str, lost: TrainerRankLost, seconds: float,
                metrics: dict[str, float]) -> None:
        self.recoveries += 1
        pending = self._pending
        pending["trainer_recoveries"] = pending.get("trainer_recoveries", 0) + 1
        pending["trainer_recovery_s"] = pending.get("trainer_recovery_s", 0.0) + seconds
        pending.update({k: v for k, v in metrics.items() if k != "trainer_recovery_s"})
        self.events.append({"during": what, "rank": lost.rank, "cause": lost.cause,
                            "node": lost.node, "seconds": round(seconds, 3), **metrics})

    def drain(self) -> dict[str, float]:
        """The recoveries since the last drain, for a step's record (empty if none)."""
        pending, self._pending = self._pending, {}
        return pending

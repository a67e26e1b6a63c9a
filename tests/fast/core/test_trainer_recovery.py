"""A trainer call through `TrainerRecovery` (core/trainer_recovery.py): a lost rank makes the
runtime rebuild the trainer and the same call run again, returning once; a runtime that cannot
rebuild, or a rebuild that fails, ends the run with the loss and why; a call that keeps losing
ranks stops after MAX_LOSSES_PER_CALL; the recoveries' metrics reach one step's record."""

import asyncio

import pytest

from eddyrl.core.trainer_recovery import MAX_LOSSES_PER_CALL, TrainerRecovery
from eddyrl.runtime_protocol import ACTOR_DIED, TrainerRankLost, TrainerRecoverable


class Trainer:
    """A trainer that loses rank 1 on the calls listed in `lose_on` (by attempt number)."""

    def __init__(self, lose_on=(), rebuild_fails: str = "") -> None:
        self.lose_on, self.rebuild_fails = set(lose_on), rebuild_fails
        self.attempts, self.rebuilt, self.steps = 0, 0, []
        self.clock = 0.0

    def now(self) -> float:
        return self.clock

    async def train(self, batch):
        self.attempts += 1
        if self.attempts in self.lose_on:
            raise TrainerRankLost(1, "train_step", ACTOR_DIED, "killed", node="127.0.0.1")
        self.steps.append(batch)
        return {"loss": 1.0}

    async def recover_trainer(self, lost):
        if self.rebuild_fails:
            raise lost.not_recovered(self.rebuild_fails)
        self.rebuilt += 1
        self.clock += 2.5
        return {"trainer_world": 2.0, "trainer_replaced": 1.0}


class Plain(Trainer):
    recover_trainer = None  # a runtime without the capability


def _call(recovery, trainer, batch="b"):
    return asyncio.run(recovery.call("train_step", lambda: trainer.train(batch)))


def test_a_lost_rank_is_rebuilt_and_the_call_runs_again_once():
    trainer = Trainer(lose_on={1})
    recovery = TrainerRecovery(trainer, trainer.now)
    assert isinstance(trainer, TrainerRecoverable)
    assert _call(recovery, trainer) == {"loss": 1.0}
    assert trainer.steps == ["b"] and trainer.rebuilt == 1 and trainer.attempts == 2
    assert recovery.drain() == {"trainer_recoveries": 1, "trainer_recovery_s": 2.5,
                                "trainer_world": 2.0, "trainer_replaced": 1.0}
    assert recovery.drain() == {}  # one step's record only
    (event,) = recovery.events
    assert event["during"] == "train_step" and event["rank"] == 1 and event["node"] == "127.0.0.1"


def test_a_runtime_that_cannot_rebuild_ends_the_run_with_the_loss_and_why():
    trainer = Plain(lose_on={1})
    with pytest.raises(TrainerRankLost, match=r"was lost during train_step: actor died "
                       r"\(killed\); the run cannot go on without it \(this runtime cannot "
                       r"rebuild its trainer in place\)$"):
        _call(TrainerRecovery(trainer, trainer.now), trainer)
    assert trainer.steps == []


def test_a_failed_rebuild_ends_the_run_saying_why():
    trainer = Trainer(lose_on={1}, rebuild_fails="train.on_rank_loss = stop")
    with pytest.raises(TrainerRankLost, match=r"\(train\.on_rank_loss = stop\)$"):
        _call(TrainerRecovery(trainer, trainer.now), trainer)


def test_a_call_that_keeps_losing_ranks_stops():
    trainer = Trainer(lose_on=set(range(1, 10)))
    with pytest.raises(TrainerRankLost, match=f"lost a trainer rank {MAX_LOSSES_PER_CALL + 1} "
                       "times in a row"):
        _call(TrainerRecovery(trainer, trainer.now), trainer)
    assert trainer.rebuilt == MAX_LOSSES_PER_CALL and trainer.steps == []


def test_losses_on_separate_calls_each_recover():
    trainer = Trainer(lose_on={1, 3, 5})
    recovery = TrainerRecovery(trainer, trainer.now)
    for batch in "abc":
        _call(recovery, trainer, batch)
    assert trainer.steps == ["a", "b", "c"] and recovery.recoveries == 3
    assert recovery.drain()["trainer_recoveries"] == 3

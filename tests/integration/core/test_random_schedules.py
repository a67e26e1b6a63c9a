"""Randomized schedules against the real controller and streaming rollout (issue 18's proof):
the sweep. Each seed's settings, faults and checks: random_schedules.py. Below it, the trainer
losses' part of the harness (issue 37): every kind of loss is drawn, and a broken recovery is
caught.

The default run sweeps 5,000 seeds (`EDDY_SCHEDULES=N` sweeps N from `EDDY_SCHEDULE_SEED`,
`EDDY_SCHEDULE_STEPS` training steps each). A failing seed is reported with its settings, the
fewest steps that still fail, the last events, and the command that reruns it alone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from eddyrl.core.trainer_recovery import TrainerRecovery
from eddyrl.runtime_protocol import TrainerRankLost
from random_schedules import _settings, run_schedule, sweep

# The default run: 5,000 seeds of 3 training steps each (10,000 until the default suite outgrew
# CI's 15 minutes; the long-mode sweeps are in bench/results/README.md), spread over a process
# per core
# (measured: ~12 ms a schedule on one core of the 2-core CI machine, ~60 s in all idle).
# EDDY_SCHEDULES / EDDY_SCHEDULE_SEED / EDDY_SCHEDULE_STEPS change it (the long mode).
SCHEDULES = int(os.environ.get("EDDY_SCHEDULES", "5000"))
FIRST_SEED = int(os.environ.get("EDDY_SCHEDULE_SEED", "0"))
STEPS = int(os.environ.get("EDDY_SCHEDULE_STEPS", "3"))


def test_random_schedules_sweep_keeps_c1_c2_c3_and_exactly_once():
    processes = min(os.cpu_count() or 1, 8, max(1, SCHEDULES // 500))
    share = -(-SCHEDULES // processes)
    chunks = [(FIRST_SEED + i * share, min(share, SCHEDULES - i * share), STEPS)
              for i in range(processes) if SCHEDULES - i * share > 0]
    if processes == 1:
        failures = sweep(*chunks[0])
    else:  # spawned: a forked copy of a test process that loaded torch could hang
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")
                                 ) as pool:
            failures = [f for part in pool.map(sweep, *zip(*chunks)) for f in part]
    assert not failures, f"{len(failures)} schedule(s) failed:\n" + "\n".join(failures)


@pytest.fixture
def quiet():
    """The engine faults' warnings, thousands of them, off for this test only (the setting is
    the process's: later tests' log captures need it back)."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def test_the_schedules_lose_trainer_ranks_at_every_point(quiet):
    """Over the first seeds, ranks are lost in training steps and weight publishes, before the
    call took effect, after, part way through a publish, and twice in one call (a harness
    that never drew them would prove nothing)."""
    kinds, repeated = set(), 0
    for seed in range(100):
        _, runtime = run_schedule(seed)
        repeated += runtime.losses.repeated
        kinds |= {(during, "before" if point == 0 else "after" if point == effects else "part")
                  for during, point, effects in runtime.losses.where}
    assert kinds == {("train_step", "before"), ("train_step", "after"),
                     ("weight export", "before"), ("weight export", "part"),
                     ("weight export", "after")}, kinds
    assert repeated > 0


def test_some_streamed_schedules_lose_a_rank_between_the_parts_of_a_step(quiet):
    """train.stream_chunks = 2 in some schedules: a step's two calls, each committed on its
    own; ranks are lost in the second call of a step too (a harness that never drew it would
    prove nothing of a part's recovery)."""
    second_part_losses = 0
    for seed in (s for s in range(300) if _settings(s)[0]["stream"]):
        _, runtime = run_schedule(seed)
        assert [len(groups) for groups in runtime.batches] == [1] * 2 * 5  # a group a call
        # two calls a step: a call after an odd number of committed ones is a second part
        second_part_losses += sum(calls % 2 for calls in runtime.lost_in_call)
    assert second_part_losses > 0


_intact_call = TrainerRecovery.call


async def _returns_without_running_again(self, what, make):
    if what != "train_step":
        return await _intact_call(self, what, make)
    try:
        return await make()
    except TrainerRankLost as lost:
        self._record(what, lost, 0.0, await self.runtime.recover_trainer(lost))
        return {}


async def _runs_again_without_rebuild(self, what, make):
    while True:
        try:
            return await make()
        except TrainerRankLost as lost:
            self._record(what, lost, 0.0, {})


async def _uncounted(self, what, make):
    while True:
        try:
            return await make()
        except TrainerRankLost as lost:
            await self.runtime.recover_trainer(lost)


@pytest.mark.parametrize("broken", [_returns_without_running_again,
                                    _runs_again_without_rebuild, _uncounted])
def test_a_broken_trainer_recovery_fails_the_schedules(monkeypatch, quiet, broken):
    """The checks can fail: with the recovery broken, a schedule with trainer losses does."""
    monkeypatch.setattr(TrainerRecovery, "call", broken)
    failed = 0
    for seed in (s for s in range(40) if _settings(s)[0]["trainer_loss"]):
        try:
            run_schedule(seed)
        except AssertionError:
            failed += 1
    assert failed > 0

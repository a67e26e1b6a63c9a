"""How the simulated trainer's step scales with its data-parallel ranks (issue 35's check at 2x
the cluster): FSDP's collectives are charged per micro-batch and do not shrink with the ranks
(each rank gathers every weight), so the step halves only while the micro-batches a rank runs
halve with its rows; once a rank's part of an optimizer step fits one micro-batch, more ranks
keep every collective and the step stops halving."""

import math
import random

import pytest

from eddyrl.scheduler.cost_model import CostModel
from eddyrl.sim.trainer import SimBatch, SimTrainer


def _batch(rows: int, seed: int = 0) -> SimBatch:
    """dora_64's rows: 300 prompt tokens, responses log-normal (mean 2,400, sigma 1), at most
    30,000."""
    rng = random.Random(seed)
    mu = math.log(2400) - 0.5
    response = [max(1, min(30_000, round(rng.lognormvariate(mu, 1.0)))) for _ in range(rows)]
    full = tuple(300 + r for r in response)
    return SimBatch(rows, sum(response), sum(full), sum(full) / rows, full, tuple(response))


def _dora_trainer(dp: int, **options) -> SimTrainer:
    """dora_64's trainer: Qwen2.5-32B on H800 groups of 8 (Ulysses), 64 rows a micro-batch."""
    return SimTrainer(cost=CostModel("H800", "Qwen2.5-32B", tp=8), dp=dp,
                      micro_batch_rows=64, **options)


def test_a_large_batch_halves_because_each_rank_runs_half_the_micro_batches():
    """8,192 rows: 64 micro-batches a rank at dp 2, 32 at dp 4, each with the same compute
    (64 rows) and the same collectives (the whole model gathered), the collectives hidden
    under the compute but one layer's each: twice the ranks, half the step within 1 %."""
    batch = _batch(8192)
    one, two = (_dora_trainer(dp).step_cost(batch) for dp in (2, 4))
    per_micro_batch = 2 * _dora_trainer(2).train_cost.all_gather_seconds() \
        + _dora_trainer(2).train_cost.gradient_sync_seconds()
    assert one.communication_s == pytest.approx(64 * per_micro_batch)
    assert two.communication_s == pytest.approx(32 * per_micro_batch)
    assert one.exposed_communication_s < 0.01 * one.total_s
    assert two.total_s == pytest.approx(one.total_s / 2, rel=0.01)


def test_a_rank_runs_at_least_one_micro_batch_per_optimizer_step():
    """256 rows in 16 optimizer steps: at dp 32 a rank has 8 rows, half a row a step, at dp 64
    4; either way every optimizer step runs one micro-batch with all its collectives, so the
    collectives stay and the step does not halve (the compute does, nearly)."""
    batch = _batch(256)
    one, two = (_dora_trainer(dp, mini_batches=16).step_cost(batch) for dp in (32, 64))
    per_micro_batch = 2 * _dora_trainer(32).train_cost.all_gather_seconds() \
        + _dora_trainer(32).train_cost.gradient_sync_seconds()
    assert one.communication_s == pytest.approx(16 * per_micro_batch)
    assert two.communication_s >= one.communication_s
    assert two.compute_s < 0.75 * one.compute_s
    assert two.update_s > 0.8 * one.update_s

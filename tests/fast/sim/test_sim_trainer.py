"""The simulated trainer (sim/trainer.py): the batch's real row lengths, split over the ranks by
the trainer's own partition and into mini-batches as the update cuts them, with the log-prob
passes the algorithm runs."""

import math
import random

import pytest

from eddyrl.core.config import AlgorithmConfig
from eddyrl.core.partition import balanced_partition
from eddyrl.core.update_passes import forward_passes
from eddyrl.protocol import GenerationResult, Group, Trajectory
from eddyrl.scheduler.cost_model import CostModel
from eddyrl.sim.trainer import SimBatch, SimTrainer, build_sim_batch


def _batch(rows: list[int], prompt: int = 0) -> SimBatch:
    full = tuple(prompt + r for r in rows)
    return SimBatch(len(rows), sum(rows), sum(full), sum(full) / len(rows), full, tuple(rows))


def _heavy_tailed(count: int, seed: int = 0) -> SimBatch:
    rng = random.Random(seed)
    mu = math.log(2400) - 0.5  # log-normal, mean 2400, sigma 1: DAPO-Math-like
    return _batch([min(28_000, round(rng.lognormvariate(mu, 1.0))) for _ in range(count)], 300)


def _trainer(dp: int, **options) -> SimTrainer:
    return SimTrainer(cost=CostModel("H20", "Qwen2.5-7B"), dp=dp, **options)


def test_the_sim_batch_carries_each_rows_tokens():
    def trajectory(tokens: int, mask=None) -> Trajectory:
        return Trajectory(GenerationResult("r", [], [1] * tokens, [0.0] * tokens,
                                           [0] * tokens, "stop", mask))

    groups = [Group("g0", "p", "a", [1, 2, 3], 0, [trajectory(5), trajectory(7)]),
              Group("g1", "p", "a", [1], 0, [trajectory(4, [1, 0, 0, 1])])]
    batch = build_sim_batch(groups)
    assert batch.row_tokens == (8, 10, 5)
    assert batch.row_loss_tokens == (5, 7, 2)  # an environment's tokens are not trained
    assert (batch.rows, batch.tokens, batch.loss_tokens) == (3, 23, 16)


def test_a_step_is_the_trainers_partition_and_mini_batches():
    """Rows go to ranks by balanced_partition on loss tokens; each rank cuts its rows into
    consecutive mini-batches; each optimizer step waits for its slowest rank."""
    batch = _batch([4000, 100, 3000, 200, 2500, 50, 900, 1200])
    trainer = _trainer(2, mini_batches=2, passes=forward_passes(AlgorithmConfig(), 2))
    cost = trainer.step_cost(batch)
    flops = trainer.train_cost.training_flops
    peak = trainer.cost.accelerator.peak_flops * trainer.cost.efficiency.train_mfu
    ranks = [[batch.row_tokens[i] for i in rows]
             for rows in balanced_partition(list(batch.row_loss_tokens), 2)]
    expected = 0.0
    for index in range(2):
        chunks = [rank[index * 2:(index + 1) * 2] for rank in ranks]
        expected += max(sum(map(flops, chunk)) for chunk in chunks) / peak
    assert cost.compute_s == pytest.approx(expected)
    assert cost.logprob_s.keys() == {"old"}  # two optimizer steps need the pre-update pass


def test_imbalance_grows_as_sequences_per_rank_fall():
    batch = _heavy_tailed(512)  # one of verl's mini-batches: 32 prompts x 16
    imbalance = [_trainer(dp).step_cost(batch).imbalance for dp in (4, 16, 64, 128)]
    assert imbalance == sorted(imbalance)
    assert imbalance[0] < 1.05 and imbalance[-1] > 1.5


def test_the_algorithms_log_prob_passes_are_charged():
    batch = _batch([1000] * 256)  # 32 rows a rank, 8 a mini-batch
    plain = _trainer(8).step_cost(batch)
    assert plain.logprob_s == {}
    decoupled = AlgorithmConfig(decoupled=True, kl_coef=0.01)
    trainer = _trainer(8, mini_batches=4, passes=forward_passes(decoupled, 4))
    cost = trainer.step_cost(batch)
    train = trainer.train_cost
    peak = trainer.cost.accelerator.peak_flops * trainer.cost.efficiency.train_mfu
    exposed_gather = train.all_gather_seconds() / 28  # one layer's, the rest hidden
    whole = 32 * train.forward_flops(1000) / peak + exposed_gather
    quarter = 8 * train.forward_flops(1000) / peak + exposed_gather
    assert cost.logprob_s == pytest.approx({"reference": whole, "old": whole,
                                            "proximal": 3 * quarter})
    # old log-probs from the rollout engine: no pre-update pass (verl fully async)
    rollout = _trainer(8, mini_batches=4,
                       passes=forward_passes(AlgorithmConfig(), 4, rollout_logprobs=True))
    assert rollout.step_cost(batch).logprob_s == {}


def test_micro_batches_multiply_the_collectives():
    batch = _batch([1000] * 64)
    whole = _trainer(8).step_cost(batch)
    cut = _trainer(8, micro_batch_rows=2).step_cost(batch)  # 8 rows a rank: 4 micro-batches
    assert cut.communication_s == pytest.approx(4 * whole.communication_s)
    assert cut.compute_s == pytest.approx(whole.compute_s)


def test_joined_replicas_take_their_share_of_the_rows():
    batch = _heavy_tailed(256)
    alone, helped = (_trainer(8).step_cost(batch, extra_dp=extra) for extra in (0, 8))
    assert helped.compute_s == pytest.approx(alone.compute_s / 2)


def test_the_config_decides_the_steps_passes_and_checkpointing():
    from eddyrl.config import load_config

    config = load_config(overrides=["train.mini_batches=4", "algorithm.decoupled=true",
                                    "train.activation_checkpointing=full"])
    trainer = SimTrainer.from_config(config, CostModel("H20", "Qwen2.5-7B"), 4)
    assert trainer.mini_batches == 4 and trainer.checkpointing == "full"
    assert trainer.passes == forward_passes(config.algorithm, 4)
    assert [p.role for p in trainer.passes] == ["old", "proximal", "proximal", "proximal"]

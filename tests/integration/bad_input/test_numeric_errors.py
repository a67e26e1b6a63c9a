"""Bad numbers in training: a NaN/inf loss or gradient skips the optimizer step, logs it and
counts it in the step metrics (`skipped_updates`); the weights and the optimizer state are
unchanged and the next good batch trains as usual. The FSDP engine on the tiny model, on CPU,
one rank."""

import logging
import math

import pytest
import torch

from eddyrl.protocol import TrainBatch
from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.registry import load_engine_class
from eddyrl.hal import get_platform

LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    init = f"file://{tmp_path_factory.mktemp('fsdp')}/init"
    engine = load_engine_class("train", "fsdp")(tiny_model_dir, get_platform("cpu"), 0, 1, init,
                                                lr=1e-2, micro_batch_size=4, seed=0)
    yield engine
    engine.close()


def batch(field: str | None = None, value: float = 0.0, rows: int = 2) -> TrainBatch:
    """`rows` rows of 8 tokens, the last 4 trained; `field`[0, 5] set to `value`."""
    length = 8
    loss_mask = torch.zeros(rows, length)
    loss_mask[:, 4:] = 1
    signs = torch.tensor([1.0, -1.0]).repeat(rows)[:rows, None]
    tensors = dict(
        input_ids=torch.arange(5, 5 + rows * length).reshape(rows, length) % 40 + 5,
        attention_mask=torch.ones(rows, length, dtype=torch.long), loss_mask=loss_mask,
        old_logprobs=-1.0 * loss_mask, advantages=signs * loss_mask,
        sample_weights=torch.ones(rows), versions=torch.where(loss_mask > 0, 0, -1))
    if field is not None:
        tensors[field] = tensors[field].clone()
        tensors[field][0, 5] = value
    return TrainBatch(**tensors)


def state(engine):
    weights = {k: v.clone() for b in engine.export_weights(1 << 30) for k, v in b.items()}
    optim = {id(p): {k: v.clone() for k, v in s.items()} for p, s in engine.optimizer.state.items()}
    return weights, optim


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("field, value", [
    pytest.param("advantages", math.nan, id="nan-advantage"),
    pytest.param("old_logprobs", math.nan, id="nan-behaviour-logprob"),
    pytest.param("advantages", math.inf, id="inf-advantage-inf-loss"),
    pytest.param("old_logprobs", -math.inf, id="finite-loss-nan-gradient"),
])
def test_nonfinite_step_is_skipped_logged_and_counted(engine, caplog, field, value):
    if not engine.optimizer.state:
        engine.train_step(batch(), LOSS)  # the optimizer has state to keep
    before, version = state(engine), engine.version
    with caplog.at_level(logging.WARNING, logger="eddyrl.engines.training.fsdp"):
        metrics = engine.train_step(batch(field, value), LOSS)
    assert metrics["skipped_updates"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    assert same(state(engine)[0], before[0]) and same(state(engine)[1], before[1])
    assert engine.version == version + 1  # versions still count steps
    assert [r.getMessage() for r in caplog.records] == [
        f"optimizer step skipped at version {version}: the gradient norm is nan (loss "
        f"{metrics['loss']}); weights and optimizer state unchanged"]
    good = engine.train_step(batch(), LOSS)  # and the next good batch trains
    assert good["skipped_updates"] == 0.0 and math.isfinite(good["grad_norm"])
    assert not same(state(engine)[0], before[0])


def test_trainer_rank_counts_every_skipped_mini_batch(tiny_model_dir, tmp_path):
    """A step of two optimizer steps (`train.mini_batches=2`), both on NaN: two skips, as the
    step's metrics report them (a count adds up where the other metrics are means)."""
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime.trainer_rank import TrainerRank

    config = load_config(overrides=["platform=cpu", "train.mini_batches=2",
                                    f"model.path={tiny_model_dir}"])
    rank = TrainerRank(runtime_settings(config).trainer, 0, 1, f"file://{tmp_path}/pg",
                       tiny_model_dir)
    try:
        nan_rows = batch(rows=4)  # split in two mini-batches of 2 rows
        nan_rows.advantages[nan_rows.loss_mask > 0] = math.nan
        assert rank.train(nan_rows)["skipped_updates"] == 2.0
        assert rank.train(batch())["skipped_updates"] == 0.0
    finally:
        rank.engine.close()

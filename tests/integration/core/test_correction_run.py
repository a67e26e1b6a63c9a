"""The off-policy correction presets on the real trainer: a trainer rank's mismatch signals
reduced over micro-batches as the step's (a maximum as a maximum, the ESS of the whole step),
and a tiny run with `algorithm.correction=icepop` logging them every step."""

import json
import math

import pytest
import torch

from eddyrl.config import load_config
from eddyrl.resolved import runtime_settings
from eddyrl.runtime.trainer_rank import TrainerRank

LOW, HIGH = 0.9, 1.1  # narrow icepop bounds: the helper batch's noise (0.3) passes them often


def _batch(model_dir):
    from fsdp_helpers import make_batch

    batch = make_batch(model_dir)
    batch.ref_logprobs = None
    return batch


def test_a_trainer_rank_reports_the_whole_steps_signals(tiny_model_dir, tmp_path):
    # one row per micro-batch: token means of each part would not give the step's max or ESS
    config = load_config(overrides=[
        "platform=cpu", "train.lr=1e-3", "train.micro_batch_size=1", f"model.path={tiny_model_dir}",
        "cluster.threads_per_worker=1", "algorithm.correction=icepop",
        f"algorithm.correction_low={LOW}", f"algorithm.correction_high={HIGH}"])
    rank = TrainerRank(runtime_settings(config).trainer, 0, 1, f"file://{tmp_path}/pg",
                       tiny_model_dir)
    try:
        batch = _batch(tiny_model_dir)
        current = rank.engine.compute_logprobs(batch)  # prox: the weights before the step
        metrics = rank.train(batch)
    finally:
        rank.engine.close()
    on = batch.loss_mask > 0
    log_rho = (current - batch.old_logprobs)[on].double()
    rho = log_rho.exp()
    # the straightforward whole-batch values; 1e-4: the step's forward against a no-grad one
    assert metrics["mismatch_max_abs"] == pytest.approx(float(log_rho.abs().max()), abs=1e-4)
    assert metrics["mismatch_max_abs"] == pytest.approx(metrics["mismatch_abs_max"], abs=1e-4)
    ess = float(rho.sum() ** 2 / (len(rho) * rho.square().sum()))
    assert metrics["is_ess"] == pytest.approx(ess, abs=1e-4)
    kl = float((rho - 1 - log_rho).mean())
    assert metrics["mismatch_kl"] == pytest.approx(kl, abs=1e-4)
    # icepop keeps rho in [LOW, HIGH]; no ratio sits within 1e-3 of a bound, so the count is
    # the same whichever forward gave it
    assert not any(abs(float(r) - b) < 1e-3 for r in rho for b in (LOW, HIGH))
    masked = float(((rho < LOW) | (rho > HIGH)).double().mean())
    assert 0 < masked < 1
    assert metrics["correction_masked_fraction"] == pytest.approx(masked, abs=1e-6)  # fp32
    assert metrics["correction_truncated_fraction"] == 0.0


RUN = ["loop.batch_prompts=4", "loop.eval_every=0", "rollout.n_samples=4",
       "rollout.max_new_tokens=16", "data.train_size=32", "data.eval_size=4",
       "cluster.threads_per_worker=1", "data.reward_fn=reward_fixtures:length_reward",
       "algorithm.dynamic_sampling=false", "cluster.runtime=local", "loop.steps=2"]
SIGNALS = ("mismatch_kl", "mismatch_max_abs", "is_ess", "correction_masked_fraction",
           "correction_truncated_fraction")


@pytest.mark.slow
def test_a_run_with_icepop_logs_the_signals_every_step(tiny_model_dir, tmp_path):
    from eddyrl.launch import train

    run_dir = tmp_path / "icepop"
    config = load_config(overrides=[f"model.path={tiny_model_dir}", f"run_dir={run_dir}",
                                    "platform=cpu", *RUN, "algorithm.correction=icepop"])
    train(config)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()][1:]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert all(math.isfinite(m[name]) for name in SIGNALS), m
        # the engine samples with the trainer's weights (synchronous, same dtype): rho = 1 up to
        # float noise, nothing masked at [0.5, 5], every weight alike
        assert m["mismatch_max_abs"] < 1e-3 and m["mismatch_kl"] < 1e-6
        assert m["correction_masked_fraction"] == 0.0
        assert m["is_ess"] == pytest.approx(1.0, abs=1e-4)

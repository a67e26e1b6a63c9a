"""The RL update (core/update.py) against a scripted training engine: which engine calls it
makes, in which order, with which log-probs on the batch, and what it reports.

The scripted engine's log-prob of a token is a function of the token id and of the engine's
version (one optimizer step: +1), so a test can say which weights any log-prob came from."""

import pytest
import torch

from eddyrl.core.config import AlgorithmConfig
from eddyrl.core.update import PolicyUpdate, logit_temperature, logprob_mismatch
from eddyrl.protocol import TrainBatch


def _logprobs(input_ids: torch.Tensor, version: int) -> torch.Tensor:
    return -0.1 * input_ids.float() - 0.5 * version


class ScriptedTrainer:
    """A `TrainingEngine` that records its calls. `train_step` runs the loss it is given on its
    log-probs (so the loss sees the batch as the update prepared it) and reports the loss's
    metrics, `step` (its version before the step) and `skipped_updates` (1 on the steps named
    in `skip`)."""

    def __init__(self, *, skip: tuple[int, ...] = ()) -> None:
        self.version = 0
        self.skip = skip
        self.calls: list[tuple] = []

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self.calls.append(("compute_logprobs", batch.input_ids[:, 0].tolist(), self.version))
        return _logprobs(batch.input_ids, self.version)

    def train_step(self, batch, loss_fn, *, extra_tokens=0, external_grads=None,
                   logprobs_out=None):
        prox = None if batch.prox_logprobs is None else batch.prox_logprobs.clone()
        ref = None if batch.ref_logprobs is None else batch.ref_logprobs.clone()
        self.calls.append(("train_step", batch.input_ids[:, 0].tolist(), self.version,
                           {"prox": prox, "ref": ref, "extra_tokens": extra_tokens,
                            "logprobs_out": logprobs_out is not None}))
        current = _logprobs(batch.input_ids, self.version)
        if logprobs_out is not None:
            logprobs_out.copy_(current)
        loss, metrics = loss_fn(current, batch, batch.num_tokens() + extra_tokens)
        if external_grads is not None:
            self.calls.append(("external_grads", external_grads()))
        metrics.update({"loss": float(loss), "step": float(self.version),
                        "skipped_updates": float(self.version in self.skip)})
        self.version += 1
        return metrics


def _batch(rows: int = 4, length: int = 4) -> TrainBatch:
    """Row b is token b + 1 throughout (so the calls name their rows by first token); the
    response is every position but the first; the sampler's log-probs are the version-0
    engine's plus 0.05 * (b + 1) on the response."""
    ids = torch.arange(1, rows + 1).unsqueeze(1).repeat(1, length)
    mask = torch.ones(rows, length)
    mask[:, 0] = 0
    offsets = 0.05 * torch.arange(1, rows + 1, dtype=torch.float32).unsqueeze(1)
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask,
                      old_logprobs=(_logprobs(ids, 0) + offsets) * mask,
                      advantages=torch.where(torch.arange(rows) % 2 == 0, 1.0,
                                             -1.0).unsqueeze(1) * mask,
                      sample_weights=torch.ones(rows),
                      versions=torch.zeros(rows, length, dtype=torch.long))


def _update(mini_batches: int = 1, **algorithm) -> PolicyUpdate:
    return PolicyUpdate(AlgorithmConfig(**algorithm), mini_batches=mini_batches)


def _names(calls):
    return [(call[0], call[1]) if call[0] != "external_grads" else call[0] for call in calls]


def test_one_pass_takes_the_pre_update_logprobs_from_the_step_itself():
    engine, batch = ScriptedTrainer(), _batch()
    metrics = _update()(batch, engine)
    assert _names(engine.calls) == [("train_step", [1, 2, 3, 4])]  # no separate forward
    options = engine.calls[0][3]
    assert options["logprobs_out"] and options["prox"] is None and options["ref"] is None
    assert engine.version == 1
    # the mismatch is of the weights before the step: 0.05 * (b + 1) on 3 tokens a row
    assert metrics["mismatch_abs_max"] == pytest.approx(0.2)
    assert metrics["mismatch_abs_sum"] == pytest.approx(3 * 0.05 * (1 + 2 + 3 + 4))
    assert metrics["mismatch_tokens"] == 12.0
    assert metrics["step"] == 0.0 and metrics["skipped_updates"] == 0.0
    assert list(metrics)[:3] == ["mismatch_abs_max", "mismatch_abs_sum", "mismatch_tokens"]


def test_mini_batches_average_the_metrics_and_add_up_the_skipped_updates():
    engine, batch = ScriptedTrainer(skip=(0, 2)), _batch(rows=5)
    metrics = _update(mini_batches=3)(batch, engine)
    # the pre-update log-probs once, then one optimizer step per chunk of ceil(5 / 3) rows
    assert _names(engine.calls) == [("compute_logprobs", [1, 2, 3, 4, 5]),
                                    ("train_step", [1, 2]), ("train_step", [3, 4]),
                                    ("train_step", [5])]
    assert all(call[3]["prox"] is None and not call[3]["logprobs_out"]
               for call in engine.calls[1:])
    assert engine.version == 3
    assert metrics["step"] == pytest.approx((0 + 1 + 2) / 3)  # a mean over the steps
    assert metrics["skipped_updates"] == 2.0  # a count
    assert metrics["mismatch_tokens"] == 15.0  # of the whole batch, before the update
    assert metrics["mismatch_abs_max"] == pytest.approx(0.25)


def test_decoupled_first_chunk_reuses_the_pre_update_logprobs_later_chunks_recompute():
    engine, batch = ScriptedTrainer(), _batch()
    _update(mini_batches=2, decoupled=True)(batch, engine)
    assert _names(engine.calls) == [("compute_logprobs", [1, 2, 3, 4]),
                                    ("train_step", [1, 2]),
                                    ("compute_logprobs", [3, 4]), ("train_step", [3, 4])]
    first, second = engine.calls[1], engine.calls[3]
    # the proximal policy is the weights at the start of each optimizer step
    torch.testing.assert_close(first[3]["prox"], _logprobs(batch.input_ids[:2], 0))
    torch.testing.assert_close(second[3]["prox"], _logprobs(batch.input_ids[2:], 1))
    assert second[2] == 1


def test_decoupled_with_one_mini_batch_takes_the_separate_forward():
    engine, batch = ScriptedTrainer(), _batch()
    _update(decoupled=True)(batch, engine)
    assert _names(engine.calls) == [("compute_logprobs", [1, 2, 3, 4]),
                                    ("train_step", [1, 2, 3, 4])]
    torch.testing.assert_close(engine.calls[1][3]["prox"], _logprobs(batch.input_ids, 0))


def test_the_kl_reference_gives_its_logprobs_before_any_step_and_is_never_stepped():
    update = _update(mini_batches=2, kl_coef=0.1)
    assert update.needs_reference and not _update().needs_reference
    engine, reference, batch = ScriptedTrainer(), ScriptedTrainer(), _batch()
    reference.version = 3  # other weights than the engine's, to tell them apart
    metrics = update(batch, engine, reference)
    assert _names(reference.calls) == [("compute_logprobs", [1, 2, 3, 4])]
    assert reference.version == 3
    torch.testing.assert_close(batch.ref_logprobs, _logprobs(batch.input_ids, 3))
    for call in engine.calls[1:]:  # each chunk carries its rows of the reference
        torch.testing.assert_close(call[3]["ref"], _logprobs(batch.input_ids[
            [row - 1 for row in call[1]]], 3))
    assert metrics["kl_ref"] > 0


def test_the_replicas_gradients_are_fetched_inside_the_step_and_reported():
    engine, batch = ScriptedTrainer(), _batch()
    grads = {"w": torch.ones(2)}
    metrics = _update()(batch, engine, replicas=lambda: (grads, {"replicas_joined": 2.0,
                                                                 "replica_loss": 0.5}),
                        replica_tokens=7)
    assert _names(engine.calls) == [("train_step", [1, 2, 3, 4]), "external_grads"]
    assert engine.calls[0][3]["extra_tokens"] == 7
    assert engine.calls[1][1] is grads
    assert metrics["replicas_joined"] == 2.0 and metrics["replica_loss"] == 0.5


def test_a_replica_share_takes_the_proximal_logprobs_when_decoupled():
    class Replica:
        def __init__(self):
            self.calls = []

        def logprobs(self, batch):
            self.calls.append("logprobs")
            return _logprobs(batch.input_ids, 5)

        def gradients(self, batch, loss_fn, total_tokens):
            self.calls.append(("gradients", batch.prox_logprobs is not None, total_tokens))
            return {}, {"loss": 0.0}

    for decoupled, want in ((False, [("gradients", False, 30)]),
                            (True, ["logprobs", ("gradients", True, 30)])):
        replica = Replica()
        _update(decoupled=decoupled).replica_gradients(_batch(), replica, 30)
        assert replica.calls == want


def test_logprob_mismatch_of_a_batch_with_no_loss_tokens_is_zero():
    batch = _batch()
    batch.loss_mask.zero_()
    assert logprob_mismatch(batch, torch.zeros(4, 4)) == {
        "mismatch_abs_max": 0.0, "mismatch_abs_sum": 0.0, "mismatch_tokens": 0.0}


def test_the_trainer_divides_logits_by_the_samplers_temperature_greedy_at_one():
    assert logit_temperature(0.7) == 0.7
    assert logit_temperature(0.0) == 1.0

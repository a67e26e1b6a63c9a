"""The FSDP training engine's contract on CPU, one rank, with the embedded tiny model."""

import os

import pytest
import torch
from fsdp_helpers import assert_takes_the_plain_step, hf_logprobs, make_batch, save_tiny_model

from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.registry import load_engine_class
from eddyrl.hal import get_platform

LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def batch(model_dir):
    return make_batch(model_dir)


@pytest.fixture
def make_engine(model_dir, tmp_path):
    """Engines built on demand; each joins its own fresh one-rank group and is closed after."""
    engine_class = load_engine_class("train", "fsdp")
    opened = []

    def build(**overrides):
        kwargs = dict(lr=1e-3, micro_batch_size=3, seed=0)
        kwargs.update(overrides)
        init = f"file://{tmp_path}/init{len(opened)}"
        engine = engine_class(model_dir, get_platform("cpu"), 0, 1, init, **kwargs)
        opened.append(engine)
        return engine

    yield build
    for engine in opened:
        engine.close()


def _weights(engine):
    return {k: v.clone() for bucket in engine.export_weights(1 << 30) for k, v in bucket.items()}


def test_logprobs_match_a_plain_forward_at_temperature(make_engine, model_dir, batch):
    engine = make_engine(temperature=0.7)  # 4 rows in micro-batches of 3: 3 + 1
    got = engine.compute_logprobs(batch)
    want = hf_logprobs(model_dir, batch.input_ids, batch.attention_mask, temperature=0.7)
    assert got.shape == batch.input_ids.shape and torch.all(got[:, 0] == 0)
    real = batch.attention_mask.bool()
    assert (got - want)[real].abs().max().item() < 1e-5
    assert torch.all(got[~real] == 0)  # padding: 0


def test_length_sorted_cut_micro_batches_take_the_padded_batchs_step(make_engine, model_dir,
                                                                    batch):
    """The optimised path (issue 20): micro-batches of like-length rows, each cut after its
    longest row (`engines/training/packing.py::micro_batches`). Pinned to the straightforward
    computation: one plain transformers forward and backward over the whole padded batch, in
    row order. The step's loss, gradient norm and pre-update log-probs agree to float
    summation order."""
    from eddyrl.engines.training.packing import micro_batches

    parts = micro_batches(batch, 2)  # rows of 9, 6, 7 and 6 tokens: (6, 6) then (7, 9)
    assert [m.rows.tolist() for m in parts] == [[1, 3], [2, 0]]
    assert [m.batch.input_ids.shape[1] for m in parts] == [6, 9]
    engine = make_engine(micro_batch_size=2)
    got_logprobs = torch.full(batch.input_ids.shape, float("nan"))
    metrics = engine.train_step(batch, LOSS, logprobs_out=got_logprobs)

    assert_takes_the_plain_step(model_dir, batch, LOSS, metrics, got_logprobs)


def test_train_step_updates_weights_and_version(make_engine, batch):
    engine = make_engine()
    before = _weights(engine)
    metrics = engine.train_step(batch, LOSS)
    after = _weights(engine)
    assert engine.version == 1
    assert metrics["tokens"] == batch.num_tokens() == 14
    for key in ("loss", "grad_norm", "clip_fraction", "approx_kl", "ratio_mean", "kl_ref"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["grad_norm"] > 0 and 0 < metrics["clip_fraction"] < 1
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "model.embed_tokens.weight" in changed and len(changed) > len(before) // 2


def test_one_pass_step_gives_the_separate_passes_logprobs_and_the_same_update(make_engine,
                                                                              batch):
    """The optimised path (issue 20): the update's own forward hands back the pre-update
    log-probs (`logprobs_out`) instead of a second `compute_logprobs` pass. Pinned to the
    straightforward path on the same batch and weights: log-probs within 1e-6 (train- and
    eval-mode forwards of a dropout-free model; measured max difference 0 here), and the
    update itself bit-identical (the step's arithmetic is unchanged)."""
    straight, one_pass = make_engine(), make_engine()
    want = straight.compute_logprobs(batch)
    metrics = straight.train_step(batch, LOSS)
    got = torch.full(batch.input_ids.shape, float("nan"))  # every row must be written
    assert one_pass.train_step(batch, LOSS, logprobs_out=got) == metrics
    assert (got - want).abs().max().item() < 1e-6
    after, want_after = _weights(one_pass), _weights(straight)
    assert all(torch.equal(after[k], want_after[k]) for k in want_after)


def test_a_step_without_loss_tokens_leaves_the_weights(make_engine, batch):
    engine = make_engine()
    engine.train_step(batch, LOSS)  # Adam now has momentum that would move the weights
    before = _weights(engine)
    empty = batch.select(slice(0, 2))
    empty.loss_mask = torch.zeros_like(empty.loss_mask)
    metrics = engine.train_step(empty, LOSS)
    assert metrics["tokens"] == 0 and metrics["loss"] == 0 and engine.version == 2
    assert all(torch.equal(v, before[k]) for k, v in _weights(engine).items())
    engine.train_step(batch.select(slice(0, 0)), LOSS)  # no rows at all on this rank
    assert engine.version == 3


def test_export_streams_every_hf_weight_in_buckets(make_engine, model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    bucket_bytes = 64 * 1024
    buckets = list(make_engine().export_weights(bucket_bytes))
    assert len(buckets) > 1
    for bucket in buckets:  # a bucket exceeds the size only when it is a single large tensor
        size = sum(t.numel() * t.element_size() for t in bucket.values())
        assert size <= bucket_bytes or len(bucket) == 1
    exported = {k: v for bucket in buckets for k, v in bucket.items()}
    assert list(exported) == list(reference)  # HF names, HF order, tied lm_head included
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name


def test_save_load_round_trip_restores_weights_and_optimizer(make_engine, batch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = make_engine()
    first.train_step(batch, LOSS)
    saved = _weights(first)
    checkpoint = str(tmp_path / "ckpt")
    first.save(checkpoint)
    first.save(checkpoint)  # replacing an existing checkpoint leaves no staging dirs behind
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt"]
    first.train_step(batch, LOSS)
    expected_next = _weights(first)
    first.close()

    second = make_engine()
    second.load(checkpoint)
    assert second.version == 1
    assert all(torch.equal(v, saved[k]) for k, v in _weights(second).items())
    second.offload()
    second.onload()
    second.train_step(batch, LOSS)  # Adam's second step: differs unless the moments came back
    for name, tensor in _weights(second).items():
        assert torch.equal(tensor, expected_next[name]), name

    plain = AutoModelForCausalLM.from_pretrained(checkpoint)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    assert AutoTokenizer.from_pretrained(checkpoint).chat_template
    # the optimizer state is safetensors + JSON: no pickled DCP index to unpickle on load
    optim = os.listdir(os.path.join(checkpoint, "optim"))
    assert "param_groups.json" in optim and ".metadata" not in optim
    assert any(name.endswith(".safetensors") for name in optim)


def test_checkpoint_before_the_first_step_keeps_a_fresh_optimizer(make_engine, batch, tmp_path):
    fresh = make_engine()
    fresh.save(str(tmp_path / "v0"))
    fresh.train_step(batch, LOSS)  # saving must not have created Adam state
    expected = _weights(fresh)
    fresh.load(str(tmp_path / "v0"))
    assert fresh.version == 0
    fresh.train_step(batch, LOSS)
    assert all(torch.equal(v, expected[k]) for k, v in _weights(fresh).items())


def test_joined_replica_gradients_added_to_a_core_rank_equal_the_union_batch(make_engine,
                                                                              model_dir, batch):
    """Libra's elastic pool: a core rank training on part A plus a joined replica's gradients
    on part B take the same step as one rank on A and B together (same normalisation, same
    clipping), with no communicator for the replica."""
    from eddyrl.engines.training.replica import GradientReplica

    loss = make_policy_loss(clip_low=0.2, clip_high=0.28)  # the replica carries no reference
    a, b = batch.select(slice(0, 3)), batch.select(slice(3, len(batch)))
    assert b.loss_mask.sum() > 0 and a.loss_mask.sum() > 0

    def captured_step(engine, *args, **kwargs):
        grads = {}
        step = engine.optimizer.step

        def record():
            for name, p in engine.model.named_parameters():
                full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = full.detach().clone()
            step()

        engine.optimizer.step = record
        metrics = engine.train_step(*args, **kwargs)
        return grads, metrics

    union, union_metrics = captured_step(make_engine(), batch, loss)
    replica = GradientReplica(model_dir, get_platform("cpu"), micro_batch_size=2)
    replica.load_weights(0, _weights(make_engine()))
    total = int(batch.loss_mask.sum())
    replica_grads, sums = replica.gradients(b, loss, total)
    split, split_metrics = captured_step(make_engine(), a, loss,
                                         extra_tokens=int(b.loss_mask.sum()),
                                         external_grads=lambda: replica_grads)
    assert union.keys() == split.keys()
    for name in union:
        torch.testing.assert_close(split[name], union[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")
    assert split_metrics["tokens"] == union_metrics["tokens"] == total
    assert split_metrics["grad_norm"] == pytest.approx(union_metrics["grad_norm"], rel=1e-5)
    assert split_metrics["loss"] + sums["loss"] == pytest.approx(union_metrics["loss"], rel=1e-5)

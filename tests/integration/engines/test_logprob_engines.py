"""The chunked log-prob head in the engines (engines/training/logprob.py, packing.py), pinned to
the straightforward forward (`fsdp_helpers.plain_logprobs`: the whole [B, L, vocab] logits and
their fp32 log-softmax).

On the tiny model: the row and shared-prompt packed layouts give the straightforward log-probs,
entropies and gradients for chunks smaller than, not dividing, and larger than the scored
positions; the FSDP engine (world size 1, gloo) with chunking takes the plain step and reports
the straightforward mean entropy over loss tokens, also with an untied LM head, and keeps the
HF names of its weights; the GradientReplica (no FSDP) gives the straightforward gradients.
Tolerance: 1e-5 (relative for gradients and the loss), float summation order only.
"""

import pytest
import torch
from fsdp_helpers import (assert_takes_the_plain_step, make_batch, plain_logprobs,
                          save_tiny_model)
from packing_cases import grouped_batch
from transformers import AutoModelForCausalLM

from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.registry import load_engine_class
from eddyrl.engines.training.logprob import PolicyForward
from eddyrl.engines.training.packing import micro_batches, micro_logprobs, place_rows
from eddyrl.hal import get_platform

LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    from eddyrl.models.tiny import TinyModelConfig, build_tiny_model, build_tokenizer

    path = str(tmp_path_factory.mktemp("untied"))
    tokenizer = build_tokenizer()
    config = TinyModelConfig(num_hidden_layers=2, tie_word_embeddings=False)
    build_tiny_model(tokenizer, 1, config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def plain_entropy(model, batch, temperature):
    """[B, L] entropy of the straightforward distribution predicting each token; 0 at
    position 0 and on padding."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    entropy = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
    return entropy * batch.attention_mask


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("share_prompts, chunk", [(False, 2), (True, 5), (False, 10_000),
                                                  (True, 0)])
def test_both_layouts_give_the_straightforward_logprobs_entropies_and_gradients(
        model_dir, share_prompts, chunk):
    batch = grouped_batch(3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(0))
    want = plain_logprobs(model, batch.input_ids, batch.attention_mask, 0.8)
    want_entropy = plain_entropy(model, batch, 0.8)
    (want * weights + want_entropy).sum().backward()
    want_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    got = torch.zeros(batch.input_ids.shape)
    got_entropy = torch.zeros(batch.input_ids.shape)
    parts = micro_batches(batch, 4, share_prompts=share_prompts)
    assert any(m.packed is not None for m in parts) == share_prompts
    for micro in parts:
        logprobs, entropy = micro_logprobs(model, micro, 0.8, chunk)
        real = micro.batch.attention_mask
        (logprobs * weights[micro.rows, :logprobs.shape[1]] * real + entropy * real).sum() \
            .backward()
        place_rows(got, micro.rows, micro.batch, logprobs.detach())
        place_rows(got_entropy, micro.rows, micro.batch, entropy.detach())
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(got_entropy, want_entropy.detach(), rtol=0, atol=1e-5)
    grads = _grads(model)
    assert (grads - want_grads).norm() <= 1e-5 * want_grads.norm()


@pytest.fixture
def make_engine(tmp_path):
    opened = []

    def build(path, **kwargs):
        engine = load_engine_class("train", "fsdp")(
            path, get_platform("cpu"), 0, 1, f"file://{tmp_path}/pg{len(opened)}", lr=1e-3,
            **kwargs)
        opened.append(engine)
        return engine

    yield build
    for engine in opened:
        engine.close()


@pytest.mark.parametrize("share_prompts", [False, True])
def test_fsdp_step_with_chunks_takes_the_plain_step_and_reports_its_entropy(
        model_dir, make_engine, share_prompts):
    batch = grouped_batch(7)
    engine = make_engine(model_dir, micro_batch_size=5, share_prompts=share_prompts,
                         logprob_chunk_tokens=3)
    assert isinstance(engine.root, PolicyForward) and engine.root.model is engine.model
    got = torch.full(batch.input_ids.shape, float("nan"))
    metrics = engine.train_step(batch, LOSS, logprobs_out=got)
    assert_takes_the_plain_step(model_dir, batch, LOSS, metrics, got)

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        entropy = plain_entropy(plain, batch, 1.0)
    want = float((entropy * batch.loss_mask).sum() / batch.loss_mask.sum())
    assert metrics["entropy"] == pytest.approx(want, rel=1e-5)


def test_fsdp_with_an_untied_head_takes_the_plain_step_and_keeps_hf_names(
        untied_model_dir, make_engine, tmp_path):
    """The head's own weight (not the embeddings') is gathered and its gradient reduced by
    the root; the weights keep their HF names in exports and checkpoints."""
    batch = make_batch(untied_model_dir)
    engine = make_engine(untied_model_dir, micro_batch_size=3, logprob_chunk_tokens=2)
    names = list(AutoModelForCausalLM.from_pretrained(untied_model_dir).state_dict())
    assert "lm_head.weight" in names
    exported = [n for bucket in engine.export_weights(1 << 30) for n in bucket]
    assert exported == names
    got = torch.full(batch.input_ids.shape, float("nan"))
    metrics = engine.train_step(batch, LOSS, logprobs_out=got)
    assert_takes_the_plain_step(untied_model_dir, batch, LOSS, metrics, got)
    engine.save(str(tmp_path / "ckpt"))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt")).state_dict()
    assert list(saved) == names


def test_replica_with_chunks_gives_the_straightforward_gradients(model_dir):
    from eddyrl.engines.training.replica import GradientReplica

    batch = make_batch(model_dir)
    total = int(batch.loss_mask.sum())
    replica = GradientReplica(model_dir, get_platform("cpu"), micro_batch_size=3,
                              logprob_chunk_tokens=4)
    grads, sums = replica.gradients(batch, LOSS, total)

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss, _ = LOSS(plain_logprobs(plain, batch.input_ids, batch.attention_mask), batch, total)
    loss.backward()
    assert sums["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, param in plain.named_parameters():
        assert (grads[name] - param.grad).norm() <= 1e-5 * param.grad.norm(), name
    with torch.no_grad():
        entropy = plain_entropy(plain, batch, 1.0)
    assert sums["entropy"] == pytest.approx(float((entropy * batch.loss_mask).sum()), rel=1e-5)
    got = replica.logprobs(batch)
    want = plain_logprobs(plain, batch.input_ids, batch.attention_mask).detach()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

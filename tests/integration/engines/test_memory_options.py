"""The FSDP engine's memory settings pinned to the plain step, on CPU with the tiny Qwen3:
activation checkpointing (`full`, `selective`), offload (`optimizer`, `all`) and token-budget
micro-batches, in the row layout and the shared-prompt packed one. Each takes the plain
full-batch step (loss, gradient norm and pre-update log-probs to float summation order: 1e-5,
`assert_takes_the_plain_step`), keeps the Hugging Face parameter names, and checkpoints and
colocated offload/onload keep working.

On a CPU "host" and "device" are one memory, so the offload tests run the code paths (the moves,
FSDP2's CPU offload policy, the optimizer on the host) but cannot see memory move."""

import pytest
import torch
from fsdp_helpers import assert_takes_the_plain_step
from packing_cases import grouped_batch
from tests.integration.engines.test_fsdp_engine import _weights, batch, make_engine, model_dir  # noqa: F401 (fixtures)
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.training.checkpointing import apply_activation_checkpointing
from eddyrl.engines.training.packing import micro_batches
from eddyrl.engines.training.replica import GradientReplica
from eddyrl.hal import get_platform

LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
PACKED_LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28)  # the grouped batch has no ref


def _pinned_step(engine, model_dir, batch, loss):
    got = torch.full(batch.input_ids.shape, float("nan"))
    metrics = engine.train_step(batch, loss, logprobs_out=got)
    assert_takes_the_plain_step(model_dir, batch, loss, metrics, got)


# ---- activation checkpointing -------------------------------------------------------------
class _AttentionCalls(TorchDispatchMode):
    """Counts the attention kernel's forward calls (what a recompute would run again)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.calls += "scaled_dot_product" in name and "backward" not in name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind, recomputed", [("none", 0), ("full", 1), ("selective", 0)])
def test_the_backward_reruns_the_attention_only_under_full(model_dir, kind, recomputed):
    """What each kind keeps: `full` reruns every layer's attention in the backward, `selective`
    keeps the kernel's output (on this CPU torch, sdpa runs
    aten._scaled_dot_product_flash_attention_for_cpu) and reruns the rest."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = list(model.model.layers)
    apply_activation_checkpointing(model, layers, kind)
    ids = torch.randint(5, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, use_cache=False).logits.logsumexp(-1).mean()
    counter = _AttentionCalls()
    with counter:
        loss.backward()
    assert counter.calls == recomputed * len(layers)


@pytest.mark.parametrize("kind", ["full", "selective"])
def test_checkpointed_step_takes_the_plain_step_and_keeps_hf_names(make_engine, model_dir,
                                                                   batch, kind, tmp_path):
    engine = make_engine(activation_checkpointing=kind)
    _pinned_step(engine, model_dir, batch, LOSS)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    saved = _weights(engine)
    assert list(saved) == list(reference.state_dict())  # export: HF names, HF order
    assert [n for n, _ in engine.model.named_parameters()] == \
        [n for n, _ in reference.named_parameters()]  # gradients by name (elastic replicas)
    engine.save(str(tmp_path / "ckpt"))  # a Hugging Face checkpoint, as without
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"))
    assert all(torch.equal(t, saved[n]) for n, t in plain.state_dict().items())
    engine.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(t, saved[n]) for n, t in _weights(engine).items())


@pytest.mark.parametrize("kind", ["full", "selective"])
def test_checkpointed_packed_step_takes_the_plain_step(make_engine, model_dir, kind):
    engine = make_engine(activation_checkpointing=kind, micro_batch_size=5, share_prompts=True)
    assert engine.share_prompts
    _pinned_step(engine, model_dir, grouped_batch(7), PACKED_LOSS)


# ---- offload ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["optimizer", "all"])
def test_offloaded_steps_are_the_plain_steps_through_checkpoints_and_colocation(
        make_engine, model_dir, batch, tmp_path, kind):
    """The first step is the plain full-batch step; after a save and the colocated offload() /
    onload(), the second (which reads Adam's moments back) gives the plain engine's weights;
    an engine resumed from the save, moved off and back, takes that same second step."""
    plain, offloaded = make_engine(), make_engine(offload=kind)
    _pinned_step(offloaded, model_dir, batch, LOSS)
    plain.train_step(batch, LOSS)
    offloaded.save(str(tmp_path / "ckpt"))
    offloaded.offload()
    offloaded.onload()
    assert offloaded.train_step(batch, LOSS)["loss"] == pytest.approx(
        plain.train_step(batch, LOSS)["loss"], rel=1e-6)
    want, got = _weights(plain), _weights(offloaded)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-7)
    resumed = make_engine(offload=kind)
    resumed.load(str(tmp_path / "ckpt"))
    resumed.offload()
    resumed.onload()
    resumed.train_step(batch, LOSS)  # wrong unless the moments came back
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, got[name]), name


def test_an_unknown_setting_is_refused_naming_it_before_joining_a_group(make_engine):
    from eddyrl.errors import ConfigError
    from eddyrl.hal import distributed as hd

    with pytest.raises(ConfigError, match="offload = 'gpu'"):
        make_engine(offload="gpu")
    with pytest.raises(ConfigError, match="activation_checkpointing = 'some'"):
        make_engine(activation_checkpointing="some")
    assert not hd.is_initialized()


# ---- token-budget micro-batches -----------------------------------------------------------
def test_token_budget_step_takes_the_plain_step(make_engine, model_dir, batch):
    engine = make_engine(micro_batch_size=4, max_tokens_per_micro_batch=12)
    parts = engine._micro_batches(batch)
    assert len(parts) > len(micro_batches(batch, 4))  # the budget, not the rows, cut them
    assert all(m.batch.input_ids.numel() <= 12 for m in parts)
    _pinned_step(engine, model_dir, batch, LOSS)


def test_token_budget_packed_step_takes_the_plain_step(make_engine, model_dir):
    grouped = grouped_batch(7)
    engine = make_engine(micro_batch_size=8, share_prompts=True, max_tokens_per_micro_batch=24)
    assert len(engine._micro_batches(grouped)) > len(
        micro_batches(grouped, 8, share_prompts=True))
    _pinned_step(engine, model_dir, grouped, PACKED_LOSS)


def test_a_joined_replica_cuts_the_engines_micro_batches(make_engine, model_dir, batch):
    options = dict(micro_batch_size=4, max_tokens_per_micro_batch=12)
    engine = make_engine(**options)
    replica = GradientReplica(model_dir, get_platform("cpu"), **options)
    assert [m.rows.tolist() for m in replica._micro_batches(batch)] == \
        [m.rows.tolist() for m in engine._micro_batches(batch)]

"""The engines on the platform's device, with the tiny model shipped in the package
(`eddyrl/assets/tiny_warmstart`): the `hf` inference engine (generation, abort, sleep/wake) and
the FSDP training engine at world size 1 (a step, and its weights into the inference engine).

The helpers (`requests`, `collect`, `greedy`, `make_trainer`, ...) are also what the accelerator
tests in tests/hardware use. Engines and transformers are imported inside the functions: the
platform checks must not pay for them.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from importlib import resources
from pathlib import Path

import torch

from ..hal import HostChannel, Platform
from .common import device_of

# Token ids of the tiny character vocabulary; lengths 5, 3, 8 and 2 (so the sampler left-pads).
PROMPTS = ((1, 35, 33, 19, 5), (1, 20, 7), (1, 9, 9, 30, 31, 12, 8, 2), (1, 40))
LOSS_SETTINGS = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
BUCKET_BYTES = 64 * 1024  # several buckets for the tiny model
DEADLINE_S = 600.0  # one generate call, against a hang only


def model_dir() -> str:
    """The tiny warm start shipped as package data (a source checkout or an installed wheel)."""
    path = resources.files("eddyrl") / "assets" / "tiny_warmstart"
    if not isinstance(path, Path) or not (path / "config.json").is_file():
        raise FileNotFoundError(f"the package's tiny model is missing at {path}: reinstall "
                                "eddyrl (the wheel ships eddyrl/assets/tiny_warmstart)")
    return str(path)


# ---- helpers, shared with tests/hardware -----------------------------------------------------
def policy_loss():
    from ..core.losses import make_policy_loss

    return make_policy_loss(**LOSS_SETTINGS)


def requests(prefix: str, max_new: int, temperature: float, prompts=PROMPTS) -> list:
    from ..protocol import GenerationRequest, SamplingParams

    return [GenerationRequest(f"{prefix}{i}", list(prompt),
                              SamplingParams(max_new_tokens=max_new + 3 * i,
                                             temperature=temperature))
            for i, prompt in enumerate(prompts)]


def collect(engine, reqs: list) -> list:
    """Every result of one generate call, by request id."""
    async def run():
        return [r async for r in engine.generate(reqs)]

    async def bounded():
        return await asyncio.wait_for(run(), DEADLINE_S)
    return sorted(asyncio.run(bounded()), key=lambda r: r.request_id)


def greedy(engine, max_new: int = 16) -> tuple[list[list[int]], list[list[float]]]:
    results = collect(engine, requests("greedy", max_new, temperature=0.0))
    return [r.token_ids for r in results], [r.logprobs for r in results]


def make_trainer(model_path: str, platform: Platform, init_file: str, **overrides):
    """The FSDP engine at world size 1: its own process group, through the platform."""
    from ..engines.registry import load_engine_class

    kwargs = dict(lr=1e-3, micro_batch_size=3, seed=0)
    kwargs.update(overrides)
    engine_class = load_engine_class("train", "fsdp")
    return engine_class(model_path, platform, 0, 1, f"file://{init_file}", **kwargs)


def trained_weights(engine) -> dict[str, torch.Tensor]:
    """Full weights on the host (rank 0 of a one-rank trainer)."""
    return {k: v.detach().cpu().clone() for bucket in engine.export_weights(1 << 30)
            for k, v in bucket.items()}


def local_device_types(engine) -> set[str]:
    """Where the trainer's shards live."""
    return {(p.to_local() if hasattr(p, "to_local") else p).device.type
            for p in engine.model.parameters()}


# Rows of `train_batch`: (prompt length, response length), right-padded to LENGTH; the rows carry
# different numbers of loss tokens (tests/support/fsdp_helpers.py uses the same rows).
ROWS = ((3, 6), (4, 2), (2, 5), (5, 1))
LENGTH = 10


def batch_layout(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random token ids (from `gen`) in the ROWS layout: input ids (pad id 0 after each row),
    attention mask and loss mask."""
    rows = len(ROWS)
    input_ids = torch.randint(5, 50, (rows, LENGTH), generator=gen)
    attention_mask = torch.zeros(rows, LENGTH, dtype=torch.long)
    loss_mask = torch.zeros(rows, LENGTH)
    for row, (prompt, response) in enumerate(ROWS):
        attention_mask[row, :prompt + response] = 1
        loss_mask[row, prompt:prompt + response] = 1
    return input_ids * attention_mask, attention_mask, loss_mask


def train_batch(engine, seed: int = 0):
    """A batch whose old and reference log-probs are the trainer's own plus noise, so some
    ratios fall outside the clip range and the KL term is non-zero (the trainer computes them:
    no second copy of the model is loaded)."""
    from ..protocol import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    rows = len(ROWS)
    input_ids, attention_mask, loss_mask = batch_layout(gen)
    zeros = torch.zeros(rows, LENGTH)
    batch = TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       old_logprobs=zeros, advantages=zeros, sample_weights=torch.ones(rows),
                       versions=torch.where(loss_mask > 0, 0, -1))
    current = engine.compute_logprobs(batch).detach().cpu()

    def noise(scale):
        return scale * torch.randn(rows, LENGTH, generator=gen)
    batch.old_logprobs = (current + noise(0.3)) * loss_mask
    batch.ref_logprobs = (current + noise(0.1)) * loss_mask
    batch.advantages = torch.tensor([1.0, -0.5, -1.0, 2.0]).unsqueeze(1) * loss_mask
    batch.sample_weights = torch.tensor([1.0, 0.5, 1.0, 0.25])
    return batch


def _inference_engine(platform: Platform, path: str | None = None, seed: int = 3):
    from ..engines.inference.hf import HFInferenceEngine

    return HFInferenceEngine(path or model_dir(), platform, seed=seed)


def _check_logprobs(what: str, logprobs: list[float]) -> None:
    bad = [lp for lp in logprobs if not (math.isfinite(lp) and lp <= 0)]
    assert not bad, f"{what}: log-probs not finite and <= 0: {bad[:5]}"


# ---- checks ----------------------------------------------------------------------------------
def check_hf_generate(platform: Platform) -> str:
    """The hf engine generates on the device: finite log-probs <= 0, every token of version 0,
    and its stats add up."""
    engine = _inference_engine(platform)
    on = {p.device.type for p in engine.model.parameters()}
    assert on == {platform.device_type}, \
        f"the engine's weights are on {sorted(on)}, not on {platform.device_type!r}"
    results = collect(engine, requests("r", max_new=12, temperature=1.0))
    ids = [r.request_id for r in results]
    assert ids == [f"r{i}" for i in range(4)], f"results for {ids}, expected r0..r3"
    for r in results:
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions) > 0, \
            f"{r.request_id}: {len(r.token_ids)} tokens, {len(r.logprobs)} log-probs, " \
            f"{len(r.versions)} versions"
        assert set(r.versions) == {0}, f"{r.request_id}: versions {set(r.versions)}, not {{0}}"
        assert r.finish_reason in ("stop", "length"), \
            f"{r.request_id}: finish_reason {r.finish_reason!r}"
        _check_logprobs(r.request_id, r.logprobs)
    stats = engine.stats()
    assert stats.running == stats.waiting == 0, \
        f"after generate: {stats.running} running, {stats.waiting} waiting"
    tokens = sum(len(r.token_ids) for r in results)
    assert stats.tokens_generated == tokens, \
        f"stats().tokens_generated = {stats.tokens_generated}, the results hold {tokens}"
    return f"{len(results)} requests, {tokens} tokens on {engine.device}"


def check_hf_abort(platform: Platform) -> str:
    """An aborted request comes back at once with its partial output."""
    engine = _inference_engine(platform)

    async def scenario():
        stream = engine.generate(requests("a", max_new=120, temperature=1.0)[:3])
        results = []

        async def consume():
            async for result in stream:
                results.append(result)

        task = asyncio.create_task(consume())
        while engine.stats().tokens_generated < 9 and not task.done():
            await asyncio.sleep(0.001)
        await engine.abort(["a1"])
        await asyncio.wait_for(task, DEADLINE_S)
        return {r.request_id: r for r in results}

    results = asyncio.run(scenario())
    assert set(results) == {"a0", "a1", "a2"}, f"results for {sorted(results)}, expected a0..a2"
    aborted = results["a1"]
    assert aborted.finish_reason == "abort" and not aborted.finished, \
        f"the aborted request ended {aborted.finish_reason!r} (finished={aborted.finished})"
    assert 0 < len(aborted.token_ids) < 123, \
        f"the aborted request holds {len(aborted.token_ids)} tokens, expected 1..122"
    assert len(aborted.token_ids) == len(aborted.logprobs) == len(aborted.versions), \
        "the aborted request's tokens, log-probs and versions differ in length"
    bad = [lp for lp in aborted.logprobs if not math.isfinite(lp)]
    assert not bad, f"the aborted request has log-probs that are not finite: {bad[:5]}"
    return f"aborted after {len(aborted.token_ids)} of 123 tokens"


def check_hf_sleep_wake(platform: Platform) -> str:
    """sleep() frees the device memory of the weights, wake() brings back the same greedy
    output."""
    engine = _inference_engine(platform)
    prompts = requests("g", max_new=8, temperature=0.0)
    before = collect(engine, prompts)
    platform.synchronize()
    awake = platform.memory_info().allocated
    asyncio.run(engine.sleep())
    asleep = platform.memory_info().allocated
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    detail = "host memory: not measured"
    if platform.device_type != "cpu":  # on the CPU the "device" memory is the process's RSS
        assert asleep <= awake - weights // 2, \
            f"asleep the engine holds {asleep} bytes of device memory, awake {awake}: its " \
            f"{weights} bytes of weights did not leave the device"
        detail = f"{(awake - asleep) / 2**20:.1f} MiB freed asleep"
    asyncio.run(engine.wake())
    after = collect(engine, prompts)
    assert [r.token_ids for r in after] == [r.token_ids for r in before], \
        "greedy tokens after sleep/wake differ from those before"
    torch.testing.assert_close(torch.tensor(sum((r.logprobs for r in after), [])),
                               torch.tensor(sum((r.logprobs for r in before), [])),
                               msg=lambda m: f"greedy log-probs changed across sleep/wake: {m}")
    return detail


def check_fsdp_train_step(platform: Platform) -> str:
    """One FSDP train step at world size 1 on the device: finite metrics, weights that
    moved."""
    with tempfile.TemporaryDirectory(prefix="eddy_check_") as work:
        engine = make_trainer(model_dir(), platform, f"{work}/pg")
        try:
            on = local_device_types(engine)
            assert on == {platform.device_type}, \
                f"the trainer's shards are on {sorted(on)}, not on {platform.device_type!r}"
            batch = train_batch(engine)
            before = trained_weights(engine)
            metrics = engine.train_step(batch, policy_loss())
            after = trained_weights(engine)
            version = engine.version
        finally:
            engine.close()
    assert version == 1, f"engine.version = {version} after one step, expected 1"
    assert metrics["tokens"] == batch.num_tokens(), \
        f"the step trained {metrics['tokens']} tokens, the batch has {batch.num_tokens()}"
    for key in ("loss", "grad_norm", "clip_fraction", "approx_kl", "kl_ref"):
        assert torch.isfinite(torch.tensor(metrics[key])), f"metric {key} = {metrics[key]}"
    assert metrics["grad_norm"] > 0, f"grad_norm = {metrics['grad_norm']}, not > 0"
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "model.embed_tokens.weight" in changed and len(changed) > len(before) // 2, \
        f"the step changed {len(changed)} of {len(before)} tensors"
    assert all(torch.isfinite(t).all() for t in after.values()), \
        "weights are not finite after the step"
    return f"loss {metrics['loss']:.4f}, {len(changed)} of {len(before)} tensors changed"


def check_fsdp_weights_to_hf(platform: Platform) -> str:
    """The trained weights, through the host weight channel into the hf engine: generation
    works and matches a fresh engine built from the trainer's saved checkpoint."""
    with tempfile.TemporaryDirectory(prefix="eddy_check_") as work:
        trainer = make_trainer(model_dir(), platform, f"{work}/pg")
        try:
            trainer.train_step(train_batch(trainer), policy_loss())
            trainer.save(f"{work}/ckpt")
            channel = HostChannel(receiver=platform)
            received = []
            for bucket in trainer.export_weights(BUCKET_BYTES):
                spec = channel.describe(bucket)  # host tensors, as the runtime hands them over
                channel.send(bucket)
                received.append(channel.receive(spec))
        finally:
            trainer.close()
        assert len(received) > 1, f"the weights came in {len(received)} bucket(s)"
        on = {t.device.type for b in received for t in b.values()}
        assert on == {platform.device_type}, f"received weights are on {sorted(on)}"
        sampler = _inference_engine(platform, seed=0)
        before = greedy(sampler)
        asyncio.run(sampler.load_weights(1, received))
        after = greedy(sampler)
        fresh = greedy(_inference_engine(platform, f"{work}/ckpt", seed=0))
    assert sampler.version == 1, f"the engine's version is {sampler.version} after the load"
    for tokens, logprobs in zip(*after):
        assert tokens, "the engine generated nothing after the load"
        _check_logprobs("after the load", logprobs)
    assert after[0] == fresh[0], \
        "greedy tokens after the load differ from a fresh engine on the saved weights"
    torch.testing.assert_close(torch.tensor(sum(after[1], [])), torch.tensor(sum(fresh[1], [])),
                               msg=lambda m: f"log-probs after the load differ from a fresh "
                               f"engine's: {m}")
    assert before[1] != after[1], "the load changed nothing: were the trained weights sent?"
    return f"{len(received)} buckets on {device_of(platform)}"

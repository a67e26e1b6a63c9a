"""Shared by the FSDP engine tests (also imported by their spawned workers): the tiny model on
disk and a training batch whose rows carry different numbers of loss tokens."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from eddyrl.platform_checks.engines import LENGTH, ROWS, batch_layout
from eddyrl.protocol import TrainBatch

# ROWS: (prompt length, response length); right padding to LENGTH. Token counts 6, 2, 5, 1
# differ, so normalising per rank or per micro-batch instead of globally changes the result.
__all__ = ["LENGTH", "ROWS", "assert_takes_the_plain_step", "hf_logprobs", "join_ranks",
           "make_batch", "plain_logprobs", "save_tiny_model", "start_ranks"]


def save_tiny_model(path: str, seed: int = 0) -> str:
    from eddyrl.models.tiny import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_logprobs(model_path: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                temperature: float = 1.0) -> torch.Tensor:
    """The reference: a plain transformers forward and log_softmax, aligned like TrainBatch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    out = torch.zeros(input_ids.shape)
    out[:, 1:] = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return out


def plain_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The straightforward row-layout forward, with gradients: the whole [B, L, vocab] logits,
    their fp32 log-softmax at `temperature`, a gather; position 0 and padding 0. What the
    engines' chunked head (engines/training/logprob.py) is pinned to."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    token_logp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(token_logp, (1, 0)) * attention_mask


def make_batch(model_path: str, seed: int = 0) -> TrainBatch:
    """Old and reference log-probs are the model's own plus noise, so some ratios fall outside
    the clip range and the KL term is non-zero."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(ROWS)
    input_ids, attention_mask, loss_mask = batch_layout(gen)
    current = hf_logprobs(model_path, input_ids, attention_mask)
    noise = lambda scale: scale * torch.randn(rows, LENGTH, generator=gen)  # noqa: E731
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
        old_logprobs=(current + noise(0.3)) * loss_mask,
        advantages=torch.tensor([1.0, -0.5, -1.0, 2.0]).unsqueeze(1) * loss_mask,
        sample_weights=torch.tensor([1.0, 0.5, 1.0, 0.25]),
        versions=torch.where(loss_mask > 0, 0, -1),
        ref_logprobs=(current + noise(0.1)) * loss_mask)


def assert_takes_the_plain_step(model_path: str, batch: TrainBatch, loss_fn, metrics: dict,
                                logprobs: torch.Tensor) -> None:
    """An engine's step (its `metrics` and the `logprobs_out` it filled) is the straightforward
    one: a plain transformers forward and backward over the whole padded batch, in row order.
    Loss, gradient norm and pre-update log-probs agree to float summation order (1e-5)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    want = plain_logprobs(plain, batch.input_ids, batch.attention_mask, 1.0)
    loss, _ = loss_fn(want, batch, batch.num_tokens())
    loss.backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()
                                                if p.grad is not None]))
    loss = float(loss.detach())
    real = batch.attention_mask.bool()
    assert (logprobs - want.detach())[real].abs().max().item() < 1e-5
    assert torch.all(logprobs[~real] == 0)  # padding: 0
    assert abs(metrics["loss"] - loss) <= 1e-5 * max(1.0, abs(loss))
    assert abs(metrics["grad_norm"] - norm) <= 1e-5 * norm


def start_ranks(worker, module: str, nprocs: int, *args):
    """`worker(rank, *args)` in `nprocs` processes, forked from a fork server that imported
    `module` (the test's, where `worker` lives), torch and transformers once: much faster than
    spawn's fresh imports on two shared cores, and safe, unlike a plain fork of the test
    process, whose earlier gloo groups hang a child that frees them."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    mp.set_forkserver_preload([module, "transformers.models.qwen3.modeling_qwen3"])
    return mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method=method)


def join_ranks(context, timeout_s: float) -> None:
    """A collective mismatch hangs rather than fails: stop the ranks at a deadline."""
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):  # re-raises a rank's exception
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail(f"the ranks were still running after {timeout_s} s")

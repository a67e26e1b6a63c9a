"""Token log-probs and entropies through the LM head, a chunk of tokens at a time.

The straightforward way (`log_softmax(model(...).logits.float() / T)`, then a gather) holds the
logits and their fp32 log-softmax for every position of a micro-batch: [tokens, vocab], 13.7 GB
in fp32 for 22.5K tokens at Qwen3's vocabulary of 151,936, plus the bf16 logits, and autograd
keeps them for the backward. Here the head is an autograd function (in the style of fused
linear cross-entropy) over the final norm's output: the forward computes each chunk's logits
and log-softmax, keeps only the target's log-prob and the entropy, and drops the rest; the
backward recomputes them chunk by chunk and accumulates the gradients of the hidden states and
of the head's weight. Saved for the backward: the hidden states of the scored positions and
one entropy per token, no [tokens, vocab] tensor. Peak memory for the head: two [chunk, vocab]
buffers in the softmax dtype (plus the chunk's logits in the weight's dtype under mixed
precision) and the weight's gradient, whatever the micro-batch's length; the price is the
head's matmul once more in the backward (bench/logprob_memory.py measures both).

Numerics as in the straightforward path: the matmul in the weight's dtype (bf16 under FSDP's
mixed precision), the softmax in fp32 (fp64 for fp64 weights, so gradcheck can check it), the
logits divided by the sampler's temperature before the softmax. The weight's gradient
accumulates over chunks in fp32 (FSDP reduces it in fp32 anyway), so chunking adds no bf16
rounding per chunk.

`PolicyForward` runs the whole forward (decoder, then the chunked head) inside one module's
forward, so that FSDP2 can shard it as the root: the root's hooks gather the embeddings, final
norm and head before and reduce-scatter their gradients after. Reading `lm_head.weight` outside
the root's forward would see only this rank's shard.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...errors import ConfigError


class TokenLogProbs(NamedTuple):
    logprobs: torch.Tensor  # log p(target) under softmax(logits / T)
    entropy: torch.Tensor  # entropy of softmax(logits / T) at the same position


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, temperature: float, chunk_tokens: int = 0
                  ) -> TokenLogProbs:
    """[N] log-probs of `targets` and [N] entropies of softmax((hidden @ weight.T + bias) / T),
    `chunk_tokens` rows of `hidden` ([N, H]) at a time (0: all at once); differentiable in
    `hidden`, `weight` and `bias`, through both outputs."""
    if temperature <= 0:
        raise ConfigError(f"temperature = {temperature!r}: must be > 0")
    if chunk_tokens < 0:
        raise ConfigError(f"logprob_chunk_tokens = {chunk_tokens!r}: must be >= 0 "
                          "(0: the whole micro-batch at once)")
    return TokenLogProbs(*_ChunkedHead.apply(hidden, weight, bias, targets, float(temperature),
                                             int(chunk_tokens)))


def _softmax_dtype(weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)


def _chunks(count: int, chunk_tokens: int) -> list[slice]:
    step = chunk_tokens if chunk_tokens > 0 else max(count, 1)
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]


def _log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               temperature: float) -> torch.Tensor:
    """[n, V] log softmax(logits / T) in the softmax dtype: the chunk's logits are freed once
    it exists. log_softmax is one fused pass; recomputing it in the backward is cheaper than
    keeping a log-sum-exp per token to subtract (torch.logsumexp is several passes: measured
    4x log_softmax's time on the CPU)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).to(_softmax_dtype(weight))
    if temperature != 1.0:  # x / 1 is x: skip the pass
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens):
        count = hidden.shape[0]
        logp = torch.empty(count, dtype=_softmax_dtype(weight), device=hidden.device)
        entropy = torch.empty_like(logp)
        for part in _chunks(count, chunk_tokens):
            log_p = _log_probs(hidden[part], weight, bias, temperature)
            logp[part] = log_p.gather(1, targets[part, None]).view(-1)
            entropy[part] = -log_p.exp().mul_(log_p).sum(-1)
            del log_p  # before the next chunk's logits exist, not after
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # an unused output (often the entropy) gives None
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        # fp32 accumulators (see the module docstring), cast to the parameters' dtype at the end
        acc = _softmax_dtype(weight)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
            if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) \
            if needs_bias else None
        if grad_logp is None and grad_entropy is None:
            return grad_hidden, _cast(grad_weight, weight), _cast(grad_bias, bias), \
                None, None, None
        for part in _chunks(hidden.shape[0], ctx.chunk_tokens):
            h = hidden[part]
            log_p = _log_probs(h, weight, bias, ctx.temperature)
            # d logp_target / dz = onehot - p;  d entropy / dz = -p * (log p + entropy);
            # so dL/dz = g_logp * onehot - p * (g_logp + g_entropy * (log p + entropy)),
            # computed in place in the chunk's buffer; dL/dlogits = dL/dz / T (z = logits / T),
            # the 1 / T folded into the per-token factors
            g_logp = (torch.zeros_like(entropy[part]) if grad_logp is None
                      else grad_logp[part]) / ctx.temperature
            if grad_entropy is None:
                grad_logits = log_p.exp_().mul_(-g_logp[:, None])
            else:
                p = log_p.exp()
                grad_logits = log_p.add_(entropy[part, None]) \
                    .mul_(grad_entropy[part, None] / ctx.temperature) \
                    .add_(g_logp[:, None]).mul_(p).neg_()
                del p
            grad_logits = grad_logits.scatter_add_(1, targets[part, None], g_logp[:, None]) \
                .to(weight.dtype)
            if needs_hidden:
                grad_hidden[part] = grad_logits @ weight
            if needs_weight and grad_weight.dtype == grad_logits.dtype:
                grad_weight.addmm_(grad_logits.T, h)  # no [vocab, hidden] temporary
            elif needs_weight:
                grad_weight += grad_logits.T @ h
            if needs_bias:
                grad_bias += grad_logits.sum(0).to(acc)
            del log_p, grad_logits  # before the next chunk's logits exist, not after
        return grad_hidden, _cast(grad_weight, weight), _cast(grad_bias, bias), None, None, None


def _cast(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.to(like.dtype)


class PolicyForward(torch.nn.Module):
    """A Hugging Face causal LM whose forward gives the log-probs (and entropies) of chosen
    target tokens at chosen positions, through the chunked head. `self.model` is the causal LM
    as given (its parameter names unchanged); shard this module as FSDP's root (module
    docstring). Generic over causal LMs: the decoder is `get_decoder()` (its output already
    through the final norm) and the head `get_output_embeddings()`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        config = getattr(model, "config", None)
        for key in ("final_logit_softcapping", "logit_scale"):
            if getattr(config, key, None) not in (None, 1.0):
                raise ConfigError(f"{type(model).__name__}: config.{key} = "
                                  f"{getattr(config, key)!r} changes the logits after the LM "
                                  "head, which the chunked log-prob head does not apply")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                temperature: float, chunk_tokens: int = 0, **decoder_inputs) -> TokenLogProbs:
        """`positions`: [K] flat indices into input_ids' [B * S] of the positions whose next
        token is `targets` [K]; `decoder_inputs`: attention_mask, position_ids, ... as the
        decoder takes them. Each distinct (position, target) pair goes through the head once
        (a shared prompt's positions recur in every row that shares it)."""
        hidden = self.model.get_decoder()(input_ids=input_ids, use_cache=False,
                                          **decoder_inputs).last_hidden_state
        head = self.model.get_output_embeddings()
        vocab = head.weight.shape[0]
        unique, index = torch.unique(positions * vocab + targets, return_inverse=True)
        at, target = unique // vocab, unique % vocab
        result = head_logprobs(hidden.flatten(0, 1)[at], head.weight,
                               getattr(head, "bias", None), target, temperature, chunk_tokens)
        return TokenLogProbs(result.logprobs[index], result.entropy[index])


def as_policy(model: torch.nn.Module) -> PolicyForward:
    """`model` if it is a `PolicyForward` (sharded or not), else a fresh one around it: cheap,
    it only holds a reference. An FSDP engine passes its root, never the causal LM inside."""
    return model if isinstance(model, PolicyForward) else PolicyForward(model)

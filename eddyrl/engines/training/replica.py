"""A joined training replica (Libra's elastic pool): a rollout worker lent to training computes
gradients on its share of the batch and hands them to the trainer, whose data-parallel group
adds them to its own before the optimizer step (`FSDPTrainEngine.train_step(external_grads=)`).

It holds only the policy weights, no optimizer state: the core ranks take the step. So joining
costs one copy of the latest weights (which a rollout worker already receives after every step)
and no communicator: the gradients travel as plain tensors through the runtime (Ray's object
store), and data-parallel groups are never rebuilt.
"""

from __future__ import annotations

import torch

from ...models.config import weights_kwargs
from ...protocol import TrainBatch
from ...hal import Platform
from . import routing_replay
from .attention import attention_implementation
from .base import LossFn
from .packing import micro_batches, micro_logprobs, packs_prompts, place_rows


class GradientReplica:
    def __init__(self, model_path: str, platform: Platform, *, temperature: float = 1.0,
                 micro_batch_size: int = 8, share_prompts: bool = True,
                 max_packed_tokens: int = 8192, logprob_chunk_tokens: int = 0,
                 max_tokens_per_micro_batch: int = 0, attention: str = "auto") -> None:
        from transformers import AutoModelForCausalLM

        self.platform = platform
        self.device = platform.device(platform.local_rank())
        # attention.py, at fp32 as it computes: where the trainer's varlen needs bf16, a lent
        # worker takes the mask (the same gradients up to float summation order); varlen where
        # the platform has none at all was refused when the trainer started
        implementation = attention_implementation(
            "auto" if attention == "varlen" else attention, platform, torch.float32)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                     attn_implementation=implementation,
                                                     **weights_kwargs(model_path))
        self.model = platform.apply_model_patches(model).to(self.device)
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        # the same micro-batches as the core ranks' (packing.py), so the gradients are theirs
        self.varlen = implementation is not None
        self.share_prompts = share_prompts and not self.varlen and packs_prompts(self.model)
        self.max_packed_tokens = max_packed_tokens
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch  # 0: by rows only
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.version = -1  # no weights fetched yet
        # R3: replays a batch's `routed_experts` in the routers, as the core ranks do
        self._replay = routing_replay.RoutingReplay(self.model)

    @torch.no_grad()
    def load_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """The trainer's weights of `version` (HF names; a tied head may be absent)."""
        targets = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(weights) - set(targets))
        if unknown:
            raise KeyError(f"weights {unknown[:3]} do not belong to this model")
        for name, tensor in weights.items():
            targets[name].data.copy_(tensor.to(self.device))
        self.version = version

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] log-probs under the current weights (the proximal policy of a one-step
        update)."""
        self.model.eval()
        out = torch.zeros(batch.input_ids.shape)
        for micro in self._micro_batches(batch):
            micro = micro.to(self.device)
            place_rows(out, micro.rows, micro.batch, self._logprobs(micro).logprobs)
        return out

    def _logprobs(self, micro):
        self._replay.use(routing_replay.layout(micro))  # kept for a checkpointed recompute
        return micro_logprobs(self.model, micro, self.temperature, self.logprob_chunk_tokens)

    def _micro_batches(self, batch: TrainBatch):
        share = self.share_prompts and routing_replay.prompts_routed_alike(batch)
        return micro_batches(batch, self.micro_batch_size, share_prompts=share,
                             varlen=self.varlen, max_packed_tokens=self.max_packed_tokens,
                             max_tokens=self.max_tokens_per_micro_batch)

    def gradients(self, batch: TrainBatch, loss_fn: LossFn, total_tokens: int,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Gradients (host tensors, HF names) of this share's loss, normalised by the whole
        step's `total_tokens` like every core rank's, and its token-weighted metric sums."""
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"loss": 0.0}
        for micro in self._micro_batches(batch):
            micro = micro.to(self.device)
            logprobs, entropy = self._logprobs(micro)
            loss, metrics = loss_fn(logprobs, micro.batch, total_tokens)
            loss.backward()
            tokens = float(micro.batch.loss_mask.sum())
            sums["loss"] += float(loss.detach())
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value * tokens
            sums["entropy"] = sums.get("entropy", 0.0) + float(
                (entropy.detach() * micro.batch.loss_mask).sum())
        grads = {name: p.grad.detach().cpu() for name, p in self.model.named_parameters()
                 if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return grads, sums

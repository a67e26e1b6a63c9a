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
from .base import LossFn
from .packing import micro_batches, micro_logprobs, packs_prompts, place_rows


class GradientReplica:
    def __init__(self, model_path: str, platform: Platform, *, temperature: float = 1.0,
                 micro_batch_size: int = 8, share_prompts: bool = True,
                 max_packed_tokens: int = 8192) -> None:
        from transformers import AutoModelForCausalLM

        self.platform = platform
        self.device = platform.device(platform.local_rank())
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                     **weights_kwargs(model_path))
        self.model = platform.apply_model_patches(model).to(self.device)
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        # the same micro-batches as the core ranks' (packing.py), so the gradients are theirs
        self.share_prompts = share_prompts and packs_prompts(self.model)
        self.max_packed_tokens = max_packed_tokens
        self.version = -1  # no weights fetched yet

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
            place_rows(out, micro.rows, micro.batch,
                       micro_logprobs(self.model, micro, self.temperature))
        return out

    def _micro_batches(self, batch: TrainBatch):
        return micro_batches(batch, self.micro_batch_size, share_prompts=self.share_prompts,
                             max_packed_tokens=self.max_packed_tokens)

    def gradients(self, batch: TrainBatch, loss_fn: LossFn, total_tokens: int,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Gradients (host tensors, HF names) of this share's loss, normalised by the whole
        step's `total_tokens` like every core rank's, and its token-weighted metric sums."""
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"loss": 0.0}
        for micro in self._micro_batches(batch):
            micro = micro.to(self.device)
            logprobs = micro_logprobs(self.model, micro, self.temperature)
            loss, metrics = loss_fn(logprobs, micro.batch, total_tokens)
            loss.backward()
            tokens = float(micro.batch.loss_mask.sum())
            sums["loss"] += float(loss.detach())
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value * tokens
        grads = {name: p.grad.detach().cpu() for name, p in self.model.named_parameters()
                 if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return grads, sums

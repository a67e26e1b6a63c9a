"""Rollout routing replay (R3): the trainer's forward routes each token to the experts the
rollout engine routed it to (`rollout.routing_replay`; recorded by
engines/inference/routing.py, carried as `TrainBatch.routed_experts`).

Only the choice is replayed, never the weights: each router's gate weights are recomputed from
the trainer's own router logits, softmax over all experts taken at the replayed ones and
renormalised over them where the model's `norm_topk_prob` says (Qwen3-MoE's rule), so the
router still gets gradients through the weights. A position whose experts are unknown (-1:
the response's last token, padding, a result recorded without them) keeps the model's own
routing; the same formula gives exactly the model's own weights there.

The hooks stay on the routers for the engine's life and do nothing until `use` gives them a
forward's experts; they stay set until the next `use`, so activation checkpointing's recompute
in the backward replays the same experts.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...protocol import TrainBatch
from ..inference.routing import find_routers
from .packing import MicroBatch, row_sources


class RoutingReplay:
    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_routers(model)
        self.model_name = type(model).__name__
        self._experts: torch.Tensor | None = None  # [N, layers, top_k] of the next forward
        self._hooks = [router.register_forward_hook(self._hook(layer))
                       for layer, router in enumerate(self.routers)]

    def use(self, experts: torch.Tensor | None) -> None:
        """The experts of each position of the next forward's input, flattened [N, layers,
        top_k] (`layout`), or None: the model routes on its own."""
        if experts is not None:
            if not self.routers:
                raise ConfigError(
                    "config key 'rollout.routing_replay' = true needs a mixture-of-experts "
                    f"model: the trainer's {self.model_name} has no expert router")
            if experts.shape[1:] != (len(self.routers), self.routers[0].top_k):
                raise ValueError(
                    f"replayed experts of {experts.shape[1]} layers x top-{experts.shape[2]} "
                    f"for a model of {len(self.routers)} x top-{self.routers[0].top_k}")
            # checked once per forward here, not per layer in the hook: each check is a sync
            if experts.numel() and int(experts.max()) >= self.routers[0].num_experts:
                raise ValueError(f"replayed expert id {int(experts.max())} >= the model's "
                                 f"{self.routers[0].num_experts} experts")
        self._experts = experts

    def _hook(self, layer: int):
        def replay(module, inputs, output):
            if self._experts is None:
                return output
            logits, _, own = output
            replayed = self._experts[:, layer].to(own.device, torch.long)
            if replayed.shape[0] != logits.shape[0]:
                raise RuntimeError(f"replayed experts for {replayed.shape[0]} positions, the "
                                   f"router saw {logits.shape[0]}")
            return (logits, *gate_weights(logits, replayed, own, module.norm_topk_prob))
        return replay

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def gate_weights(logits: torch.Tensor, replayed: torch.Tensor, own: torch.Tensor,
                 normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k], experts [N, k]): the replayed experts where all k are known (>= 0), the
    router's own elsewhere, weighted by the softmax of `logits` [N, E] at them (fp32, as
    Qwen3-MoE's router), renormalised over the k when `normalize`."""
    known = (replayed >= 0).all(-1, keepdim=True)
    experts = torch.where(known, replayed, own)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def layout(micro: MicroBatch) -> torch.Tensor | None:
    """The replayed experts of `micro`'s forward input, [N, layers, top_k] over its flattened
    positions (the row layout's or the packed one's), -1 where unknown. The layout's `source`
    says where each token t is predicted, i.e. where token t - 1 is the input: that position
    takes token t - 1's experts. Positions that predict nothing (a row's last token,
    padding) keep -1."""
    rows = micro.batch
    if micro.rows is None or rows.routed_experts is None:
        return None
    experts = rows.routed_experts
    if micro.packed is None:
        source, size = row_sources(rows.attention_mask), rows.input_ids.numel()
    else:
        source, size = micro.packed.source, micro.packed.input_ids.numel()
    inputs = torch.cat([torch.full_like(experts[:, :1], -1), experts[:, :-1]], dim=1)
    out = torch.full((size, *experts.shape[2:]), -1, dtype=experts.dtype,
                     device=experts.device)
    wanted = source >= 0
    out[source[wanted]] = inputs.to(out.device)[wanted]
    return out


def prompts_routed_alike(batch: TrainBatch) -> bool:
    """Whether rows with the same prompt carry the same prompt experts: only then may they
    share the prompt's forward pass (packing.py), which routes it once. Rows of one group
    prefilled apart (on other workers, or resumed elsewhere) may differ at near ties."""
    if batch.routed_experts is None or batch.prompt_lengths is None:
        return True
    first: dict[tuple, torch.Tensor] = {}
    for i, p in enumerate(batch.prompt_lengths.tolist()):
        key = (p, tuple(batch.input_ids[i, :p].tolist()))
        experts = batch.routed_experts[i, :p]
        if not torch.equal(first.setdefault(key, experts), experts):
            return False
    return True

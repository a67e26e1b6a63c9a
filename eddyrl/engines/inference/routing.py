"""Which experts a mixture-of-experts model routed each token to: recorded by the rollout
engine (`rollout.routing_replay`), replayed by the trainer (engines/training/routing_replay.py).

A router here is the module that picks each token's experts: transformers' `*TopKRouter`
(Qwen3-MoE's `Qwen3MoeTopKRouter`, the sparse block's `gate`), whose forward takes the
flattened hidden states [N, H] and returns (router logits [N, E], top-k weights [N, k], top-k
expert ids [N, k]). The recorder hooks every router's output, in layer order, and reshapes
each forward's ids to [batch, seq, layers, top_k]: per request, since the caller knows which
batch row and positions are whose.

Row t of a record is token t as an input. A response's last token is never an input (the
engine stops before feeding it), so its experts are never known; none of the trained
log-probs depends on them either (a token's log-prob depends on the routing of the tokens
before it, causal attention), so a record simply ends one row early (`RoutedExperts`).
"""

from __future__ import annotations

from array import array

import numpy as np
import torch

from ...errors import ConfigError
from ...protocol import RoutedExperts


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's expert routers in layer order (module order is layer order)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")
            and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def require_routers(model: torch.nn.Module, what: str) -> list[torch.nn.Module]:
    """`find_routers`, refusing a model without any: routing replay needs a MoE model."""
    routers = find_routers(model)
    if not routers:
        raise ConfigError(
            f"config key 'rollout.routing_replay' = true needs a mixture-of-experts model; "
            f"{what} ({type(model).__name__}) has no expert router (a *TopKRouter module, "
            "as Qwen3-MoE's): set rollout.routing_replay = false for a dense model")
    return routers


def id_typecode(num_experts: int) -> str:
    """The array typecode that holds ids 0..num_experts-1 and -1: int8 up to 128 experts
    (ids 0..127: Qwen3-30B-A3B's 128 fit a byte)."""
    return "b" if num_experts <= 128 else "h"


class ExpertRecorder:
    """Forward hooks on every router that keep the expert ids of the latest forward pass."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = require_routers(model, "the rollout engine's model")
        self.top_k = int(self.routers[0].top_k)
        self.typecode = id_typecode(int(self.routers[0].num_experts))
        self._ids: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(self._keep) for r in self.routers]

    def _keep(self, module, inputs, output) -> None:
        self._ids.append(output[2].detach())

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """[batch, seq, layers, top_k] int16 on the host: the ids of the forward pass just run
        on a [batch, seq] input. Raises when that pass did not run every router once."""
        ids, self._ids = self._ids, []
        if len(ids) != len(self.routers):
            raise RuntimeError(f"recorded {len(ids)} router outputs for "
                               f"{len(self.routers)} routers: one forward pass at a time")
        stacked = torch.stack(ids, dim=1).to("cpu", torch.int16)  # [batch * seq, layers, k]
        return stacked.view(batch, seq, len(self.routers), self.top_k)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def with_carried(recorded: torch.Tensor, carried: RoutedExperts | None) -> torch.Tensor:
    """`recorded` [n, layers, k] with its first rows replaced by `carried`'s: tokens resumed
    from another engine keep the routing their log-probs came from."""
    if carried is None or carried.num_tokens == 0:
        return recorded
    if (carried.layers, carried.top_k) != tuple(recorded.shape[1:]):
        raise ValueError(f"resumed experts of {carried.layers} layers x top-{carried.top_k} "
                         f"for a model of {recorded.shape[1]} x top-{recorded.shape[2]}")
    rows = carried.num_tokens
    out = torch.full((max(rows, recorded.shape[0]), *recorded.shape[1:]), -1,
                     dtype=recorded.dtype)
    out[:recorded.shape[0]] = recorded
    out[:rows] = carried.as_tensor()
    return out


def as_routed(ids: torch.Tensor, typecode: str) -> RoutedExperts:
    """[n, layers, k] ids -> the compact record a result carries."""
    n, layers, top_k = ids.shape
    dtype = np.int8 if typecode == "b" else np.int16
    flat = ids.reshape(-1).numpy().astype(dtype)
    return RoutedExperts(layers, top_k, array(typecode, flat.tobytes()))


def input_rows(prompt_len: int, num_tokens: int) -> int:
    """Rows of a record of prompt + `num_tokens` response tokens: every token but the last
    response token is an input."""
    return prompt_len + max(num_tokens - 1, 0)


def from_vllm(routed, num_experts: int, carried: RoutedExperts | None = None
              ) -> RoutedExperts:
    """vLLM's `CompletionOutput.routed_experts` (an array [tokens, layers, top_k] over the
    request's tokens but the last, from `routed_experts_prompt_start` = 0: the rows of a
    record) as a record, `carried`'s rows first (`with_carried`)."""
    ids = torch.as_tensor(np.asarray(routed), dtype=torch.int16)
    if ids.dim() != 3:
        raise ValueError(f"vLLM routed_experts of shape {tuple(ids.shape)}: expected "
                         "[tokens, layers, top_k]")
    return as_routed(with_carried(ids, carried), id_typecode(num_experts))


# vLLM returns routed experts from its Model Runner V2 only (its config refuses otherwise)
VLLM_ROUTING_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def check_vllm_routing(version: str, engine_arg_names: frozenset[str], config: dict,
                       has_triton: bool = True) -> int:
    """The experts per layer of the model vLLM serves with routed-experts output, or a clear
    refusal: a vLLM release without that output (engine argument
    `enable_return_routed_experts`, vLLM 0.32 has it), one without Triton (the output comes
    from Model Runner V2 only, which needs Triton: vLLM's CPU build), or a dense model (that
    first: a dense model is refused on every engine)."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts < 1:
        raise ConfigError(
            "config key 'rollout.routing_replay' = true needs a mixture-of-experts model; "
            f"{config.get('model_type', 'the model')!r} has no experts (num_experts) in its "
            "config.json: set rollout.routing_replay = false for a dense model")
    if "enable_return_routed_experts" not in engine_arg_names:
        raise ConfigError(
            f"config key 'rollout.routing_replay' = true: vLLM {version} has no routed-experts "
            "output (engine argument enable_return_routed_experts); use rollout.engine = hf, "
            "or a vLLM release that has it")
    if not has_triton:
        raise ConfigError(
            f"config key 'rollout.routing_replay' = true: vLLM {version} returns routed experts "
            "only from its Model Runner V2, which needs Triton, and this vLLM build has none "
            "(vLLM's CPU build); use rollout.engine = hf")
    return experts

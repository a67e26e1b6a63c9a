"""The embedded tiny mixture-of-experts policy: a small Qwen3-MoE built locally.

The same tokenizer and chat template as the dense tiny policy (tiny.py), and a real
`Qwen3MoeForCausalLM`, so every engine that serves Qwen3-MoE serves it unchanged. Every layer is
sparse: a router picks 2 of the layer's experts per token, as Qwen3-MoE does (its routing
probabilities renormalised over the chosen experts), which is where rollout and trainer can
disagree. Each expert is half as wide as the dense model's MLP, so the two active experts do
the dense model's MLP work per token: the same compute, twice its MLP's weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from .config import ASSETS
from .tiny import TinyModelConfig, build_with_tokenizer

# The shipped SFT warm start; `eddyrl/assets/moe_warmstart/README.md` says how it was made.
MOE_WARMSTART_DIR = ASSETS / "moe_warmstart"

# Experts each token is routed to, as in the tiny model's description above.
EXPERTS_PER_TOKEN = 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinyMoeConfig(TinyModelConfig):
    """The shape of the embedded MoE policy: the dense tiny shape (heads of 32, see
    TinyModelConfig) with each layer's MLP replaced by `num_experts` experts, each
    `moe_intermediate_size` wide, `num_experts_per_tok` routed per token; ~1.45M parameters,
    ~0.86M of them active per token."""

    num_experts: int = 4
    num_experts_per_tok: int = EXPERTS_PER_TOKEN
    moe_intermediate_size: int = 192

    @classmethod
    def of_size(cls, hidden_size: int = 128, num_hidden_layers: int = 4,
                intermediate_size: int | None = None, num_experts: int = 4) -> "TinyMoeConfig":
        """A MoE policy `hidden_size` wide and `num_hidden_layers` deep with `num_experts`
        experts per layer, each `intermediate_size` wide (default 3 x hidden_size / 2: the two
        active experts as wide as the dense model's MLP)."""
        if num_experts < EXPERTS_PER_TOKEN:
            raise ValueError(f"experts {num_experts}: must be >= {EXPERTS_PER_TOKEN} (each "
                             f"token is routed to {EXPERTS_PER_TOKEN})")
        dense = TinyModelConfig.of_size(hidden_size, num_hidden_layers, intermediate_size)
        width = intermediate_size or 3 * hidden_size // EXPERTS_PER_TOKEN
        return cls(**{f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)},
                   num_experts=num_experts, moe_intermediate_size=width)


def build_tiny_moe_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    config: TinyMoeConfig = TinyMoeConfig(),
) -> Qwen3MoeForCausalLM:
    """A freshly initialised fp32 Qwen3-MoE sized by `config`, ids taken from `tokenizer`."""
    return build_with_tokenizer(
        Qwen3MoeForCausalLM, Qwen3MoeConfig, tokenizer, seed,
        norm_topk_prob=True,  # Qwen3-30B-A3B's: top-k weights renormalised over the chosen
        decoder_sparse_step=1,  # every layer sparse
        mlp_only_layers=[],
        output_router_logits=False,
        **dataclasses.asdict(config))


@contextlib.contextmanager
def load_balancing(model: torch.nn.Module) -> Iterator[None]:
    """Within it, a MoE model's loss includes its load-balancing loss (transformers'
    `output_router_logits`, weighted by `router_aux_loss_coef`), as MoEs are trained, so that
    SFT does not send every token to the same experts; the saved config keeps it off, so RL's
    forwards compute no router loss. A model without routers is left alone."""
    config = model.config
    if not hasattr(config, "output_router_logits"):
        yield
        return
    before, config.output_router_logits = config.output_router_logits, True
    try:
        yield
    finally:
        config.output_router_logits = before

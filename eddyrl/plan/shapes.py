"""A model's shape, read from its Hugging Face `config.json`: what a memory plan needs, no weights.

Covers the decoder-only families Eddy trains: dense Qwen3 / Qwen2 / Llama / Mistral and the
Qwen3-MoE mixture of experts. Parameter counts follow the modules transformers builds for them
(tests/integration/plan/test_model_shapes_against_transformers.py pins them to a random-init model's `sum(p.numel())`):

- per decoder layer: q/k/v/o projections (q/k/v biases on Qwen2, or where `attention_bias`),
  Qwen3's per-head q_norm/k_norm, two RMSNorms, and either a SwiGLU MLP (gate, up, down) or, on
  a MoE layer, a router [experts, hidden] and `num_experts` SwiGLU experts of width
  `moe_intermediate_size`;
- the token embeddings [vocab, hidden], the final norm, and the LM head [vocab, hidden] unless
  `tie_word_embeddings` makes it the embeddings' own parameter.

A MoE layer is one whose index is not in `mlp_only_layers` and where
`(index + 1) % decoder_sparse_step == 0` (transformers' rule for Qwen3-MoE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

# model_type -> (has Qwen3's per-head q_norm/k_norm, q/k/v always carry a bias)
FAMILIES = {
    "qwen3": (True, False),
    "qwen3_moe": (True, False),
    "qwen2": (False, True),
    "llama": (False, False),
    "mistral": (False, False),
}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    moe_intermediate: int = 0
    model_type: str = "qwen3"
    qk_norm: bool = True  # Qwen3: RMSNorm over each head of q and k
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sparse_step: int = 1  # Qwen3-MoE decoder_sparse_step
    mlp_only_layers: tuple[int, ...] = field(default=())

    # ---- which layers are what -------------------------------------------------------------
    def is_moe_layer(self, index: int) -> bool:
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.sparse_step == 0)

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- parameter counts ------------------------------------------------------------------
    def kv_projection_parameters(self, kv_heads: int | None = None) -> int:
        """One layer's k and v projections (with their biases where the family has them) for
        `kv_heads` heads (all of them by default)."""
        heads = self.kv_heads if kv_heads is None else kv_heads
        return 2 * heads * self.head_dim * (self.hidden + (1 if self.qkv_bias else 0))

    def attention_parameters(self) -> int:
        h, q = self.hidden, self.q_width
        count = h * q + q * h + self.kv_projection_parameters()
        if self.qkv_bias:
            count += q
        if self.o_bias:
            count += h
        if self.qk_norm:
            count += 2 * self.head_dim
        return count

    def norm_parameters(self) -> int:
        """Every norm's weight: two RMSNorms a layer, Qwen3's per-head q/k norms, the final."""
        per_layer = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.layers * per_layer + self.hidden

    def dense_mlp_parameters(self) -> int:
        bias = self.intermediate * 2 + self.hidden if self.mlp_bias else 0
        return 3 * self.hidden * self.intermediate + bias

    def moe_mlp_parameters(self) -> int:
        router = self.num_experts * self.hidden
        return router + self.num_experts * 3 * self.hidden * self.moe_intermediate

    def layer_parameters(self, index: int = 0) -> int:
        """Parameters of decoder layer `index` (layers differ only between dense and MoE)."""
        mlp = self.moe_mlp_parameters() if self.is_moe_layer(index) else self.dense_mlp_parameters()
        return self.attention_parameters() + mlp + 2 * self.hidden  # + the two RMSNorms

    def largest_layer_parameters(self) -> int:
        return max(self.layer_parameters(i) for i in range(self.layers))

    def decoder_parameters(self) -> int:
        return sum(self.layer_parameters(i) for i in range(self.layers))

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    def lm_head_parameters(self) -> int:
        """The LM head's own parameters: 0 when tied to the embeddings."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def root_parameters(self) -> int:
        """What the FSDP root group holds: embeddings, final norm, LM head."""
        return self.embedding_parameters() + self.hidden + self.lm_head_parameters()

    def parameters(self) -> int:
        return self.root_parameters() + self.decoder_parameters()

    def active_parameters(self) -> int:
        """Parameters one token passes through (a MoE layer: only its routed experts)."""
        if not self.num_experts:
            return self.parameters()
        unused = self.num_experts - self.experts_per_token
        expert = 3 * self.hidden * self.moe_intermediate
        return self.parameters() - self.moe_layers * unused * expert


def shape_from_config(config: dict, source: str = "config.json") -> ModelShape:
    """The shape a `config.json` describes; `source` names the file in errors."""

    def need(key: str):
        if key not in config or config[key] is None:
            raise ConfigError(f"{source}: key {key!r} is missing (needed for the memory plan)")
        return config[key]

    model_type = str(config.get("model_type", "")).lower()
    if model_type not in FAMILIES:
        raise ConfigError(f"{source}: model_type = {model_type!r} is not one of "
                          f"{sorted(FAMILIES)}")
    qk_norm, qkv_bias = FAMILIES[model_type]
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = config.get("head_dim") or hidden // heads
    # transformers 5 writes a Qwen3-MoE's expert count as num_local_experts (its attribute
    # num_experts maps to it); Qwen's own config.json files say num_experts
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    moe = {}
    if num_experts:
        moe = dict(num_experts=num_experts, experts_per_token=int(need("num_experts_per_tok")),
                   moe_intermediate=int(need("moe_intermediate_size")),
                   sparse_step=int(config.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()))
    bias = bool(config.get("attention_bias", False))
    return ModelShape(
        hidden=hidden, intermediate=int(need("intermediate_size")),
        layers=int(need("num_hidden_layers")), heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=int(head_dim),
        vocab=int(need("vocab_size")),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        model_type=model_type, qk_norm=qk_norm, qkv_bias=qkv_bias or bias, o_bias=bias,
        mlp_bias=bool(config.get("mlp_bias", False)), **moe)


def load_shape(path: str | Path) -> ModelShape:
    """The shape of the model at `path`: a model directory (its config.json) or a config file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{file}: no such file (a model directory with a config.json, or "
                          "the config.json itself)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return shape_from_config(config, str(file))

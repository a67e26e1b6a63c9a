"""What the cost model knows about machines and models: per-device peak compute, memory and links,
and per-model shapes and parameter counts.

The numbers come from the vendors' datasheets as the project gathered them. Their marks are
kept in each entry's
`source`: ✔ a spec or config value, ~ a secondary source or a derivation, ⚠ uncertain or inferred.
Peak compute is dense BF16 (the "1979 TFLOP/s" of H100/H200 is the 2:4-sparse figure). Memory
sizes are decimal (80 GB = 80e9 B), as the vendors print them. Link bandwidths are per device as
the datasheet quotes them (NVLink and HCCS: bidirectional); how much of a link a collective
really gets is the cost model's `comm_efficiency`, not a property of the device.

A CPU has no datasheet row: `measure_cpu` times a matmul and a memory copy with torch on this
machine instead. Everything else here is plain data, no I/O.

Models are built from their HF config.json values by `model_from_hf_config`, the same path a
user's model or the tiny test model takes, so the parameter counts in the table are computed,
not copied (a test checks them against the datasheet's column and against transformers).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import ConfigError
from ..validation import check_choice, check_positive

GB = 1e9  # decimal, as datasheets print sizes and bandwidths
TERA = 1e12


@dataclass(frozen=True, kw_only=True, slots=True)
class Accelerator:
    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # B/s
    intra_node_bandwidth: float  # B/s per device (NVLink / HCCS)
    inter_node_bandwidth: float  # B/s per device (IB / RoCE)
    devices_per_node: int
    source: str  # where the numbers come from, with the datasheet's marks

    def __post_init__(self) -> None:
        for key in ("peak_flops", "hbm_bytes", "hbm_bandwidth", "intra_node_bandwidth",
                    "inter_node_bandwidth", "devices_per_node"):
            check_positive(f"{self.name}.{key}", getattr(self, key))

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte of HBM traffic above which a kernel is compute-bound (roofline)."""
        return self.peak_flops / self.hbm_bandwidth


def _gbit(gigabits_per_second: float) -> float:
    return gigabits_per_second * GB / 8


# Datasheet section 1. Inter-node is one NIC per device (8 per node): 400 Gb/s IB is 50 GB/s.
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator(name="H100", peak_flops=989 * TERA, hbm_bytes=80 * GB, hbm_bandwidth=3.35 * TERA,
                intra_node_bandwidth=900 * GB, inter_node_bandwidth=_gbit(400),
                devices_per_node=8,
                source="H100 SXM: 989 ✔ [A1], 3.35 TB/s ✔, NVLink4 900 GB/s ✔ [A1], 400G IB [A10]"),
    Accelerator(name="H800", peak_flops=989 * TERA, hbm_bytes=80 * GB, hbm_bandwidth=3.35 * TERA,
                intra_node_bandwidth=400 * GB, inter_node_bandwidth=_gbit(400),
                devices_per_node=8,
                source="H800 SXM: 989 ~ (GH100) [A5], 3.35 TB/s ~, NVLink 400 GB/s ~ [A5], "
                       "8×400G IB ⚠ [A6]"),
    Accelerator(name="H200", peak_flops=989 * TERA, hbm_bytes=141 * GB, hbm_bandwidth=4.8 * TERA,
                intra_node_bandwidth=900 * GB, inter_node_bandwidth=_gbit(400),
                devices_per_node=8,
                source="H200 SXM: 989 ~ (GH100) [A2], 4.8 TB/s ✔, 900 GB/s ✔, 8×400G ⚠"),
    Accelerator(name="A100", peak_flops=312 * TERA, hbm_bytes=80 * GB,
                hbm_bandwidth=2.039 * TERA, intra_node_bandwidth=600 * GB,
                inter_node_bandwidth=_gbit(200), devices_per_node=8,
                source="A100 SXM 80G: 312 ✔ [A3], 2.039 TB/s ✔, 600 GB/s ✔, 8×200G HDR ⚠"),
    Accelerator(name="A800", peak_flops=312 * TERA, hbm_bytes=80 * GB,
                hbm_bandwidth=2.039 * TERA, intra_node_bandwidth=400 * GB,
                inter_node_bandwidth=_gbit(200), devices_per_node=8,
                source="A800 SXM 80G: 312 ~ [A4], 2.039 TB/s, 400 GB/s ~ [A4], "
                       "200 Gb/s IB (DGX A800) [A11]"),
    Accelerator(name="910B2", peak_flops=353.9 * TERA, hbm_bytes=64 * GB,
                hbm_bandwidth=1.6 * TERA, intra_node_bandwidth=196 * GB,
                inter_node_bandwidth=50 * GB, devices_per_node=8,
                source="Ascend 910B2: 353.9 ~ (24 cores × 1.8 GHz × 4096 MAC × 2; marketed 376T) "
                       "[A7], 1.6 TB/s ~, HCCS 196 GB/s ⚠, 50 GB/s per NPU ⚠"),
    Accelerator(name="910B3", peak_flops=294.9 * TERA, hbm_bytes=64 * GB,
                hbm_bandwidth=1.6 * TERA, intra_node_bandwidth=196 * GB,
                inter_node_bandwidth=50 * GB, devices_per_node=8,
                source="Ascend 910B3: 294.9 ~ (20 cores; label 313T) [A7], 1.6 TB/s ~ "
                       "(1.2 elsewhere ⚠), HCCS 196 GB/s ⚠, as 910B2 between nodes ⚠"),
    Accelerator(name="910B4", peak_flops=245.7 * TERA, hbm_bytes=32 * GB,
                hbm_bandwidth=0.8 * TERA, intra_node_bandwidth=32 * GB,
                inter_node_bandwidth=32 * GB, devices_per_node=8,
                source="Ascend 910B4: 245.7 ~ (20 cores × 1.5 GHz) [A7], 0.8 TB/s ~, "
                       "32 GB/s ⚠ both ways"),
    Accelerator(name="H20", peak_flops=148 * TERA, hbm_bytes=96 * GB, hbm_bandwidth=4.0 * TERA,
                intra_node_bandwidth=900 * GB, inter_node_bandwidth=_gbit(400),
                devices_per_node=8,
                source="H20: 148 ~ [A12], 4.0 TB/s, 900 GB/s; inter-node not in the sheet, "
                       "assumed 400G IB ⚠"),
)}
# "910B" alone usually means the 910B2 (the A2 servers in verl's and MindSpeed-RL's numbers).
ACCELERATOR_ALIASES = {"910B": "910B2"}


def lookup_accelerator(name: str) -> Accelerator:
    """The table entry for `name` (or an alias); a ConfigError lists the known names."""
    check_choice("accelerator", name, [*ACCELERATORS, *ACCELERATOR_ALIASES])
    return ACCELERATORS[ACCELERATOR_ALIASES.get(name, name)]


def measure_cpu(seconds_budget: float = 0.2) -> Accelerator:
    """This machine's CPU as an Accelerator named "cpu-measured": peak_flops from an fp32 matmul
    (CPU engines run fp32), hbm_bandwidth from a 64 MiB copy (read + write bytes), each the best
    rate seen in its half of `seconds_budget` (allocation included; at least two calls each, so
    a loaded machine can overrun it). Host RAM is the memory; the copy rate stands in for the
    "intra-node" link (processes on one host talk through shared memory); inter-node assumes
    10 GbE."""
    import torch  # here, not at module level: the tables need no torch

    check_positive("seconds_budget", seconds_budget)
    start = time.perf_counter()
    size = 512
    a, b = torch.randn(size, size), torch.randn(size, size)
    flops = _best_rate(lambda: torch.mm(a, b), 2 * size**3, until=start + seconds_budget / 2)
    source_tensor = torch.ones(16 * 2**20)  # 64 MiB of fp32: larger than most caches
    target = torch.empty_like(source_tensor)
    copied = 2 * source_tensor.numel() * source_tensor.element_size()
    bandwidth = _best_rate(lambda: target.copy_(source_tensor), copied,
                           until=start + seconds_budget)
    return Accelerator(name="cpu-measured", peak_flops=flops,
                       hbm_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                       hbm_bandwidth=bandwidth, intra_node_bandwidth=bandwidth,
                       inter_node_bandwidth=_gbit(10), devices_per_node=1,
                       source=f"measured in {seconds_budget} s: fp32 {size}×{size} matmul, "
                              f"64 MiB copy; inter-node assumed 10 GbE")


def _best_rate(work: Callable[[], object], units_per_call: float, until: float) -> float:
    """The highest units/s of `work()` over calls repeated until `until` (perf_counter time),
    at least two, so the first, which pays for warm-up, is never the only one."""
    best, calls = 0.0, 0
    while calls < 2 or time.perf_counter() < until:
        began = time.perf_counter()
        work()
        best = max(best, units_per_call / max(time.perf_counter() - began, 1e-9))
        calls += 1
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    intermediate: int  # per expert for a MoE model
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # input embedding and LM head share one matrix
    total_params: int
    active_params: int  # per token: equals total_params for a dense model
    non_embedding_params: int  # total without the embedding and the LM head
    experts: int = 0  # routed experts per layer; 0 for a dense model
    experts_per_token: int = 0

    @property
    def embedding_params(self) -> int:
        """Input embedding plus LM head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def matmul_params(self) -> int:
        """Weights each token is multiplied by: the active non-embedding ones plus the LM head
        (the input embedding is a lookup). Forward FLOPs per token are twice this."""
        return self.active_params - self.embedding_params + self.vocab * self.hidden

    @property
    def attention_flops_per_context_token(self) -> int:
        """Forward FLOPs one query token spends per token of context: QKᵀ and AV, 2·2·H·d per
        layer."""
        return 4 * self.layers * self.heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token: 2 · layers · kv_heads · head_dim · dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def params_read(self, batch: int) -> float:
        """Weights one forward step over `batch` tokens must read: every matmul weight of a dense
        model; for MoE, the experts at least one token routes to, on average a fraction
        1 - (1 - k/E)^batch of each layer's E experts if routing is uniform (k/E at batch 1)."""
        if not self.experts:
            return self.matmul_params
        routed_share = self.experts_per_token / self.experts
        routed_params = (self.total_params - self.active_params) / (1 - routed_share)
        touched_share = 1 - (1 - routed_share) ** batch
        return self.matmul_params + routed_params * (touched_share - routed_share)


def model_from_hf_config(name: str, config: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from an HF config.json dict: Qwen2/2.5 (QKV bias), Qwen3 (QK-norm), Qwen3-MoE
    and Llama-style models. Parameters are counted from the shapes (norms and biases included);
    other architectures are counted as Llama-style."""
    try:
        layers, hidden = config["num_hidden_layers"], config["hidden_size"]
        heads, vocab = config["num_attention_heads"], config["vocab_size"]
        experts = config.get("num_experts", 0)
        intermediate = config["moe_intermediate_size" if experts else "intermediate_size"]
    except KeyError as missing:
        raise ConfigError(f"config.json of model {name!r} lacks key {missing}; a ModelSpec needs "
                          f"num_hidden_layers, hidden_size, num_attention_heads, vocab_size and "
                          f"intermediate_size (moe_intermediate_size with num_experts)") from None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    top_k = config.get("num_experts_per_tok", 0) if experts else 0
    tied = bool(config.get("tie_word_embeddings", False))
    model_type = config.get("model_type", "")

    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    attention = 2 * hidden * q_width + 2 * hidden * kv_width  # q, o; k, v
    if config.get("attention_bias", model_type == "qwen2"):
        attention += q_width + 2 * kv_width
    if model_type.startswith("qwen3"):
        attention += 2 * head_dim  # q_norm, k_norm
    mlp = 3 * hidden * intermediate  # gate, up, down
    router = hidden * experts
    norms = 2 * hidden
    layer_total = attention + norms + (experts * mlp + router if experts else mlp)
    layer_active = attention + norms + (top_k * mlp + router if experts else mlp)
    non_embedding = layers * layer_total + hidden  # + the final norm
    embedding = vocab * hidden * (1 if tied else 2)
    return ModelSpec(name=name, layers=layers, hidden=hidden, intermediate=intermediate,
                     heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab=vocab, tied=tied,
                     total_params=non_embedding + embedding,
                     active_params=layers * layer_active + hidden + embedding,
                     non_embedding_params=non_embedding, experts=experts,
                     experts_per_token=top_k)


def _qwen_config(model_type: str, layers: int, hidden: int, intermediate: int, heads: int,
                 kv_heads: int, vocab: int, tied: bool, experts: int = 0,
                 experts_per_token: int = 0) -> dict[str, Any]:
    config = {"model_type": model_type, "num_hidden_layers": layers, "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128,
              "vocab_size": vocab, "tie_word_embeddings": tied}
    if experts:
        config.update(moe_intermediate_size=intermediate, num_experts=experts,
                      num_experts_per_tok=experts_per_token)
    else:
        config["intermediate_size"] = intermediate
    return config


# Datasheet section 2: config.json values ✔ [M1], Qwen3-1.7B [M2]. Qwen3-8B is not in the sheet:
# its public config (used by the sheet's decode calibration points, section 3a).
# Columns: model_type, layers, hidden, intermediate, heads, kv_heads, vocab, tied[, experts, top-k].
_QWEN_CONFIG_ROWS: dict[str, tuple[Any, ...]] = {
    "Qwen2.5-7B": ("qwen2", 28, 3584, 18944, 28, 4, 152064, False),
    "Qwen2.5-32B": ("qwen2", 64, 5120, 27648, 40, 8, 152064, False),
    # Qwen2.5-Math-7B: the Qwen2.5-7B shape (28 layers, 3584 / 18944, 28/4 heads, 152064 vocab,
    # untied) ~ (a verl checkpoint of it: huggingface.co/tmpmodelsave/iter_dpo_math_prompt50
    # config.json); it differs in max_position_embeddings 4096 (QwenLM/Qwen2.5-Math issue 59),
    # which verl's fully-async recipe raises to 32768, and rope_theta, neither a cost
    "Qwen2.5-Math-7B": ("qwen2", 28, 3584, 18944, 28, 4, 152064, False),
    # DeepSeek-R1-Distill-Qwen-1.5B (AReaL's math runs): its config.json as copies of it carry
    # it (_name_or_path deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B, e.g.
    # huggingface.co/rohinm/model config.json) ~
    "DeepSeek-R1-Distill-Qwen-1.5B": ("qwen2", 28, 1536, 8960, 12, 2, 151936, False),
    "Qwen3-1.7B": ("qwen3", 28, 2048, 6144, 16, 8, 151936, True),
    "Qwen3-4B": ("qwen3", 36, 2560, 9728, 32, 8, 151936, True),
    "Qwen3-8B": ("qwen3", 36, 4096, 12288, 32, 8, 151936, False),
    "Qwen3-14B": ("qwen3", 40, 5120, 17408, 40, 8, 151936, False),
    "Qwen3-32B": ("qwen3", 64, 5120, 25600, 64, 8, 151936, False),
    "Qwen3-30B-A3B": ("qwen3_moe", 48, 2048, 768, 32, 4, 151936, False, 128, 8),
}
MODELS: dict[str, ModelSpec] = {name: model_from_hf_config(name, _qwen_config(*row))
                                for name, row in _QWEN_CONFIG_ROWS.items()}


def lookup_model(name: str) -> ModelSpec:
    """The table entry for `name`; a ConfigError lists the known names."""
    check_choice("model", name, MODELS)
    return MODELS[name]

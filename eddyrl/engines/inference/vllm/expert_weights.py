"""A mixture of experts' weights between the trainer and vLLM: their names, and the CPU
experts' layout after a weight update.

transformers 5 holds a Qwen3-MoE layer's experts fused, as two 3D tensors (`...mlp.experts.
gate_up_proj` [experts, 2 x width, hidden]: each expert's gate rows then its up rows;
`...mlp.experts.down_proj` [experts, hidden, width]), and that is what the trainer and the `hf`
engine send in a weight update. The checkpoint on disk, and what vLLM's reload takes, has one
matrix per expert (`...mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`):
save_pretrained splits them. So the adapter checks an update's names in the fused form
(`fused_names`) and the worker splits the tensors just before vLLM's reload (`split_experts`).
Only the Qwen3-MoE naming is known here; a model whose checkpoint names its experts otherwise
keeps its checkpoint names, and a fused update to it is refused by name as before.

vLLM 0.32's CPU experts kernel (`CPUUnquantizedExperts`) prepacks the expert weights into its
grouped-GEMM layout after loading, but an in-place reload skips that step
(`UnquantizedFusedMoEMethod._setup_kernel` runs the experts' `process_weights_after_loading`
on the first load only), so after a weight update the kernel reads plain weights as packed
ones: measured on the tiny MoE, log-probs off by up to 0.4 and other greedy tokens, even
reloading the same weights. `repack_cpu_experts` runs that step again after each reload
(log-probs then equal hf's within 1e-6). Should a vLLM release repack on reload itself, this
would pack twice: tests/integration/engines/test_vllm_moe.py, which compares with hf after
updates, fails then.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

_CHECKPOINT = re.compile(r"^(?P<prefix>.*\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def fused_names(names: Iterable[str]) -> set[str]:
    """Checkpoint names with each layer's per-expert matrices replaced by the two fused names
    the trainer sends; every other name as it is."""
    fused = set()
    for name in names:
        match = _CHECKPOINT.match(name)
        if match is None:
            fused.add(name)
        else:
            kind = "down_proj" if match["proj"] == "down_proj" else "gate_up_proj"
            fused.add(f"{match['prefix']}.{kind}")
    return fused


def split_experts(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights with each fused expert tensor split into its checkpoint matrices (views, no
    copy); every other weight as it is."""
    for name, tensor in weights:
        match = _FUSED.match(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix = match["prefix"]
        for expert, matrix in enumerate(tensor.unbind(0)):
            if match["proj"] == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", matrix
            else:
                gate, up = matrix.chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up


def repack_cpu_experts(model: torch.nn.Module | None) -> int:
    """After a weight reload, the CPU experts' prepack of every MoE layer of a vLLM `model`
    that a reload skips (see above); returns the layers repacked (0 off the CPU kernel, or for
    a worker that exposes no model). A layer whose experts the kernel pads is refused: the
    reload's copy and the padding would not line up."""
    repacked = 0
    for layer in model.modules() if model is not None else ():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ != "CPUUnquantizedExperts":
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise NotImplementedError(
                f"vLLM's CPU experts pad this model's expert width "
                f"({config.intermediate_size_per_partition}); Eddy cannot update such a "
                "mixture of experts in place on vLLM's CPU build: use rollout.engine=hf")
        experts.process_weights_after_loading(layer)
        repacked += 1
    return repacked

"""A mixture of experts' weight updates into vLLM, without vLLM
(engines/inference/vllm/expert_weights.py): the fused expert tensors the trainer sends split
into the checkpoint's per-expert matrices, their names folded back for the update's checks, and
the CPU experts' prepack run again after a reload on every MoE layer (stand-in layers here;
tests/integration/engines/test_vllm_moe.py runs it in vLLM), a padded expert width refused."""

from types import SimpleNamespace

import pytest
import torch

from eddyrl.engines.inference.vllm.expert_weights import (fused_names, repack_cpu_experts,
                                                           split_experts)

PREFIX = "model.layers.3.mlp.experts"


def test_fused_experts_split_into_each_experts_gate_up_and_down_matrices():
    gate_up = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)  # 3 experts, width 2
    down = -torch.arange(3 * 2 * 2, dtype=torch.float32).reshape(3, 2, 2)
    other = torch.ones(2)
    split = dict(split_experts([(f"{PREFIX}.gate_up_proj", gate_up),
                                (f"{PREFIX}.down_proj", down), ("model.norm.weight", other)]))
    assert len(split) == 3 * 3 + 1
    for e in range(3):  # each expert's gate rows first, then its up rows
        assert torch.equal(split[f"{PREFIX}.{e}.gate_proj.weight"], gate_up[e, :2])
        assert torch.equal(split[f"{PREFIX}.{e}.up_proj.weight"], gate_up[e, 2:])
        assert torch.equal(split[f"{PREFIX}.{e}.down_proj.weight"], down[e])
    assert split["model.norm.weight"] is other


def test_checkpoint_names_fold_into_the_fused_names_the_trainer_sends():
    names = {f"{PREFIX}.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj",
                                                                      "down_proj")}
    names |= {"model.layers.3.mlp.gate.weight", "model.embed_tokens.weight"}
    assert fused_names(names) == {f"{PREFIX}.gate_up_proj", f"{PREFIX}.down_proj",
                                  "model.layers.3.mlp.gate.weight", "model.embed_tokens.weight"}
    dense = {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    assert fused_names(dense) == dense


class CPUUnquantizedExperts:  # vLLM's CPU experts kernel, found by its class name
    def __init__(self, width, padded):
        self.moe_config = SimpleNamespace(intermediate_size_per_partition=width)
        self.padded, self.repacked = padded, []

    def _padded_intermediate_size(self, config):
        return self.padded

    def process_weights_after_loading(self, layer):
        self.repacked.append(layer)


def _model(*kernels):
    model = torch.nn.Sequential(*(torch.nn.Module() for _ in kernels), torch.nn.Linear(2, 2))
    for layer, kernel in zip(model, kernels):
        layer.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=kernel))
    return model


def test_every_cpu_moe_layer_is_repacked_once_and_nothing_else():
    kernels = [CPUUnquantizedExperts(192, 192), CPUUnquantizedExperts(192, 192)]
    model = _model(*kernels, SimpleNamespace())  # another kernel (a GPU one): left alone
    assert repack_cpu_experts(model) == 2
    assert [k.repacked for k in kernels] == [[model[0]], [model[1]]]
    assert repack_cpu_experts(torch.nn.Linear(2, 2)) == 0  # a dense model
    assert repack_cpu_experts(None) == 0  # a worker that exposes no model


def test_a_padded_expert_width_is_refused_naming_it():
    with pytest.raises(NotImplementedError, match=r"pad this model's expert width \(40\)"):
        repack_cpu_experts(_model(CPUUnquantizedExperts(40, 64)))

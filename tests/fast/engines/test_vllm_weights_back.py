"""The `vllm` engine's weights given back (engines/inference/vllm/weights_back.py), pure logic on
stand-in modules with vLLM's attributes: stacked layers un-stacked by the model's
`packed_modules_mapping` and each layer's row sizes, a weight the CPU backend packed away read
through the layer's GEMM on the identity, the padded vocabulary cut, a tied head under both
names, a staged update over the hosted weights, what is refused and why, and the worker's copy
handed over in buckets. (In vLLM on the tiny model: test_vllm_engine.py.)"""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from eddyrl.engines.inference.base import WeightsNotHeld
from eddyrl.engines.inference.vllm.weights_back import WeightsBack, fetch_held, read_back

HIDDEN, VOCAB, PADDED = 8, 10, 16


class Linear(nn.Module):
    """A vLLM linear layer: rows stacked by `sizes`; `packed_away`: the CPU backend's empty
    parameter and its GEMM (`cpu_linear`) over a weight it keeps elsewhere."""

    def __init__(self, sizes, bias=False, packed_away=False, tp_size=1):
        super().__init__()
        self.output_partition_sizes, self.input_size, self.tp_size = sizes, HIDDEN, tp_size
        self.full = torch.randn(sum(sizes), HIDDEN)
        if packed_away:
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            self.cpu_linear = lambda x, weight, bias: x @ self.full.t()
        else:
            self.weight = nn.Parameter(self.full.clone(), requires_grad=False)
        self.register_parameter("bias", nn.Parameter(torch.randn(sum(sizes)), False)
                                if bias else None)


class Embedding(nn.Module):
    """vLLM's vocabulary embedding: rows padded past the model's vocabulary; it has a linear
    layer's sizes too (the padded ones)."""

    def __init__(self, added=0):
        super().__init__()
        self.org_vocab_size, self.num_added_embeddings, self.tp_size = VOCAB, added, 1
        self.output_partition_sizes, self.input_size = [PADDED], HIDDEN
        self.weight = nn.Parameter(torch.randn(PADDED, HIDDEN), requires_grad=False)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN), requires_grad=False)


class Experts(nn.Module):
    """vLLM's routed experts: a module below the checkpoint's `experts` prefix, which it
    keeps as its `layer_name`."""

    def __init__(self):
        super().__init__()
        self.layer_name = "model.layers.0.mlp.experts"
        self.w13_weight = nn.Parameter(torch.randn(2, 12, HIDDEN), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.randn(2, HIDDEN, 6), requires_grad=False)


class Model(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, **layer):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = Embedding()
        block = nn.Module()
        block.self_attn = nn.Module()
        block.self_attn.qkv_proj = Linear([8, 4, 4], bias=True)
        block.self_attn.o_proj = Linear([HIDDEN], packed_away=True)
        block.mlp = nn.Module()
        block.mlp.gate_up_proj = Linear([6, 6], packed_away=True)
        block.input_layernorm = Norm()
        for name, module in layer.items():
            setattr(block.mlp, name, module)
        self.model.layers = nn.ModuleList([block])
        self.lm_head = Embedding()
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as vLLM's tie_weights


def _expected(model):
    """The trainer's (HF) names and tensors for `Model`, from the stand-ins' own tensors."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = attn.qkv_proj.full.split([8, 4, 4])
    qb, kb, vb = attn.qkv_proj.bias.split([8, 4, 4])
    gate, up = mlp.gate_up_proj.full.split([6, 6])
    embed = model.model.embed_tokens.weight[:VOCAB]
    at = "model.layers.0."
    return {"model.embed_tokens.weight": embed, "lm_head.weight": embed,
            at + "self_attn.q_proj.weight": q, at + "self_attn.k_proj.weight": k,
            at + "self_attn.v_proj.weight": v, at + "self_attn.q_proj.bias": qb,
            at + "self_attn.k_proj.bias": kb, at + "self_attn.v_proj.bias": vb,
            at + "self_attn.o_proj.weight": attn.o_proj.full,
            at + "mlp.gate_proj.weight": gate, at + "mlp.up_proj.weight": up,
            at + "input_layernorm.weight": model.model.layers[0].input_layernorm.weight}


def test_stacked_layers_come_back_apart_under_the_trainers_names():
    torch.manual_seed(0)
    model = Model()
    expected = _expected(model)
    held = read_back(model)
    assert set(held) == set(expected)
    for name, tensor in expected.items():  # exact: splits, the identity GEMM, the cut
        assert torch.equal(held[name], tensor), name
    assert held["lm_head.weight"].shape == (VOCAB, HIDDEN)


def test_a_staged_update_goes_over_the_hosted_weights_and_its_layers_are_not_read():
    torch.manual_seed(1)
    model = Model()
    gate_up = model.model.layers[0].mlp.gate_up_proj
    gate_up.cpu_linear = None  # read, it would be refused: the staged update covers it
    at = "model.layers.0.mlp."
    staged = {at + "gate_proj.weight": torch.ones(6, HIDDEN),
              at + "up_proj.weight": torch.zeros(6, HIDDEN),
              "model.embed_tokens.weight": torch.full((VOCAB, HIDDEN), 2.0)}
    held = read_back(model, staged)
    assert held[at + "gate_proj.weight"] is staged[at + "gate_proj.weight"]
    # the tied head decodes with its embedding's update
    assert torch.equal(held["lm_head.weight"], staged["model.embed_tokens.weight"])
    hosted = _expected(model)
    assert torch.equal(held["model.layers.0.self_attn.q_proj.weight"],
                       hosted["model.layers.0.self_attn.q_proj.weight"])
    # not staged, a layer that cannot be read is refused, naming it
    with pytest.raises(WeightsNotHeld, match="mlp.gate_up_proj"):
        read_back(model)


def test_hosted_experts_are_refused_but_staged_ones_come_back():
    model = Model(experts=nn.Module())
    model.model.layers[0].mlp.experts.routed_experts = Experts()
    with pytest.raises(WeightsNotHeld, match=r"'model.layers.0.mlp.experts.routed_experts'.*"
                                             "mixture of "
                                             "experts.*prepacks"):
        read_back(model)
    staged = {"model.layers.0.mlp.experts.gate_up_proj": torch.ones(2, 12, HIDDEN),
              "model.layers.0.mlp.experts.down_proj": torch.ones(2, HIDDEN, 6)}
    held = read_back(model, staged)
    assert set(staged) <= set(held) and not any("routed_experts" in name for name in held)


@pytest.mark.parametrize("layer, reason", [
    (Linear([HIDDEN], tp_size=2), "tensor-parallel slice.*not built"),
    (Embedding(added=4), "4 added vocabulary rows"),
    (Linear([4, 4]), "stacks 2 parts"),  # stacked, but not in packed_modules_mapping
])
def test_what_cannot_be_read_back_is_refused_naming_the_layer_and_why(layer, reason):
    with pytest.raises(WeightsNotHeld, match=reason):
        read_back(Model(odd=layer))


def test_a_quantized_or_relaid_linear_is_refused():
    quantized = Linear([HIDDEN])
    quantized.weight_scale = nn.Parameter(torch.ones(HIDDEN), requires_grad=False)
    with pytest.raises(WeightsNotHeld, match=r"'model.layers.0.mlp.odd'.*\['weight_scale'\]"):
        read_back(Model(odd=quantized))
    relaid = Linear([HIDDEN])
    relaid.weight = nn.Parameter(relaid.full.t().reshape(4, 16), requires_grad=False)
    with pytest.raises(WeightsNotHeld, match=r"\(4, 16\), not \(8, 8\).*layout of its own"):
        read_back(Model(odd=relaid))


class _Worker(WeightsBack):
    def __init__(self, model, dtype):
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.model_config = SimpleNamespace(dtype=dtype)
        self.calls = []

    async def rpc(self, method, *args):  # collective_rpc's one worker
        self.calls.append(method)
        return getattr(self, method)(*args)


def test_the_worker_hands_its_copy_over_in_buckets_in_the_engines_dtype():
    torch.manual_seed(2)
    model = Model()
    worker = _Worker(model, torch.bfloat16)
    expected = _expected(model)
    held = asyncio.run(fetch_held(worker.rpc, frozenset(expected), bucket_bytes=64))
    assert worker.calls.count("eddy_held_bucket") > 3  # small buckets: several messages
    assert set(held) == set(expected) and "_eddy_held" not in vars(worker)
    for name, tensor in expected.items():
        assert held[name].dtype == torch.bfloat16 and held[name].device.type == "cpu"
        assert torch.equal(held[name], tensor.to(torch.bfloat16)), name
    # names the trainer never sends are left out; a name it sends and the model lacks refused
    fewer = frozenset(expected) - {"lm_head.weight"}
    assert set(asyncio.run(fetch_held(worker.rpc, fewer))) == fewer
    with pytest.raises(WeightsNotHeld, match=r"lacks weights the trainer sends: \['x.weight'\]"):
        asyncio.run(fetch_held(worker.rpc, frozenset(expected) | {"x.weight"}))


def test_a_refusal_in_the_worker_comes_back_as_its_reason():
    worker = _Worker(Model(experts=Experts()), torch.float32)
    with pytest.raises(WeightsNotHeld, match="mixture of experts"):
        asyncio.run(fetch_held(worker.rpc, None))
    assert worker.calls == ["eddy_take_held"] and "_eddy_held" not in vars(worker)

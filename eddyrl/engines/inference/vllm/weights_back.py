"""The `vllm` engine's weights given back (`held_weights`): what its worker decodes with, under
the trainer's (Hugging Face) names, for a trainer rebuilt without buddy copies.

vLLM's model holds its weights under its own layout: stacked layers (Qwen3's `qkv_proj` is
q_proj, k_proj, v_proj along the output rows; `gate_up_proj` is gate_proj, up_proj), read back
apart from the model itself (its `packed_modules_mapping` names the parts, each stacked layer's
`output_partition_sizes` their rows); a vocabulary padded to a multiple of 64 rows (cut back
to the model's); a tied output head that is the embedding's parameter (given under both names,
as the trainer's state dict has it). vLLM's CPU backend keeps no plain linear weight after
loading: it packs each into its GEMM library's layout (oneDNN, or the AMX kernel's) and leaves
an empty parameter, so such a layer's weight is read back through its own GEMM, on the
identity: exact (each output is one weight times 1 plus zeros, accumulated in at least the
weights' precision), and what the engine computes with.

An update staged but not yet applied (`WeightStaging`) is newer than the hosted weights, so it
goes over them: the result is what the engine decodes with once it applies. A layer whose
weights the staged update covers is not read from the model at all.

Not built, refused by `WeightsNotHeld` naming the layer: a mixture of experts' hosted experts
(each experts kernel keeps its own layout; vLLM's CPU kernel prepacks them, expert_weights.py;
experts come back only from a staged update), quantized layers (parameters other than weight
and bias), tensor parallelism (each worker holds a slice; `VLLMInferenceEngine` runs one
worker), a vocabulary with added rows (LoRA's extra vocabulary).

The worker side runs in vLLM's engine-core process (mixed into `transfer.WorkerExtension`): no
vLLM import here. The worker takes a host copy (on the CPU backend: views of its own weights,
read while the adapter lets no update commit or apply), which crosses `collective_rpc` in
buckets (`pack`): no one message holds the whole model.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import torch

from ..base import WeightsNotHeld
from .weights import PackedTensor, pack, unpack

BUCKET_BYTES = 256 << 20  # one RPC message's share of the copy


def read_back(model: torch.nn.Module, staged: dict[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
    """The weights `model` decodes with once `staged` (trainer names) is applied, under the
    trainer's names: the staged ones, and each of the model's layers that `staged` leaves
    out, un-stacked. Tensors as the model or the update holds them (views, any device)."""
    staged = dict(staged or {})
    packed = getattr(model, "packed_modules_mapping", None) or {}
    weights: dict[str, torch.Tensor] = {}
    owners: dict[int, str] = {}  # a parameter's first name: a tied one is its owner's
    aliases: dict[str, str] = {}
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        prefix = f"{name}." if name else ""
        for pname, param in params.items():
            owner = owners.setdefault(id(param), prefix + pname)
            if owner != prefix + pname:
                aliases[prefix + pname] = owner
        names = _trainer_names(name, module, params, packed)
        if all(n in staged or n in aliases for n in names):
            continue
        if getattr(module, "tp_size", 1) > 1:
            raise WeightsNotHeld(f"layer {name!r} is a tensor-parallel slice (tp_size "
                                 f"{module.tp_size}): gathering the slices is not built")
        weights.update(_read(name, module, params, names))
    weights.update(staged)
    for alias, owner in aliases.items():  # what a tied head decodes with: its owner's update
        weights[alias] = weights[owner]
    return weights


_LINEAR_PARAMS = ("weight", "bias")  # a linear layer's weights, in the order read


def _is_linear(module) -> bool:
    return (hasattr(module, "output_partition_sizes") and hasattr(module, "input_size")
            and not hasattr(module, "org_vocab_size"))  # an embedding has both, padded


def _trainer_names(name: str, module, params: dict, packed: dict[str, list[str]]
                   ) -> list[str]:
    """The names the trainer gives this layer's weights."""
    prefix = f"{name}." if name else ""
    if "w13_weight" in params or "w2_weight" in params:  # fused experts (expert_weights.py),
        # under the checkpoint's prefix (vLLM's module sits below it: `experts.routed_experts`)
        experts = getattr(module, "layer_name", None) or name
        return [f"{experts}.gate_up_proj", f"{experts}.down_proj"]
    parent, _, leaf = name.rpartition(".")
    if _is_linear(module) and leaf in packed:
        return [f"{parent}.{part}.{p}" if parent else f"{part}.{p}"
                for p in _LINEAR_PARAMS if p in params for part in packed[leaf]]
    if _is_linear(module):
        return [prefix + p for p in _LINEAR_PARAMS if p in params]
    return [prefix + p for p in params]


def _read(name: str, module, params: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """One layer's weights under `names` (see `_trainer_names`), read from the model."""
    if "w13_weight" in params or "w2_weight" in params:
        raise WeightsNotHeld(
            f"layer {name!r} holds a mixture of experts: reading hosted experts back is not "
            "built (each experts kernel keeps its own layout; vLLM's CPU one prepacks them); "
            "only experts staged in an update not yet applied come back")
    if hasattr(module, "org_vocab_size"):  # a vocabulary, padded to a multiple of rows
        if getattr(module, "num_added_embeddings", 0):
            raise WeightsNotHeld(f"layer {name!r} has {module.num_added_embeddings} added "
                                 "vocabulary rows: reading them back is not built")
        return {n: p.detach()[:module.org_vocab_size] for n, p in zip(names, params.values())}
    if _is_linear(module):
        extra = sorted(set(params) - set(_LINEAR_PARAMS))
        if extra:
            raise WeightsNotHeld(f"layer {name!r} has parameters {extra}: a quantized layer; "
                                 "reading it back is not built")
        sizes = list(module.output_partition_sizes)
        tensors = {"weight": _linear_weight(name, module)}
        if params.get("bias") is not None:
            tensors["bias"] = params["bias"].detach()
        parts = [t.split(sizes, dim=0) for t in tensors.values()]
        if len(names) != len(tensors) * len(sizes):
            raise WeightsNotHeld(f"layer {name!r} stacks {len(sizes)} parts, its model's "
                                 f"packed_modules_mapping names {len(names) // len(tensors)}")
        return dict(zip(names, (part for split in parts for part in split)))
    return {n: p.detach() for n, p in zip(names, params.values())}


def _linear_weight(name: str, module) -> torch.Tensor:
    """A linear layer's [output rows, input columns] weight: its parameter, or, where vLLM's
    CPU backend packed it away (an empty parameter and the layer's `cpu_linear`), its own
    GEMM on the identity (x W^T with x = I is W^T, exactly)."""
    weight = module.weight
    shape = (sum(module.output_partition_sizes),
             getattr(module, "input_size_per_partition", module.input_size))
    if tuple(weight.shape) == shape:
        return weight.detach()
    gemm = getattr(module, "cpu_linear", None)
    if weight.numel() == 0 and callable(gemm):
        with torch.no_grad():
            eye = torch.eye(shape[1], dtype=weight.dtype, device=weight.device)
            product = gemm(eye, weight, None)
        if tuple(product.shape) == shape[::-1]:
            return product.t()
    raise WeightsNotHeld(f"layer {name!r}: its weight is {tuple(weight.shape)}, not "
                         f"{shape}: vLLM keeps it in a layout of its own")


# ---- worker side ------------------------------------------------------------------------------
class WeightsBack:
    """Mixed into vLLM's worker (`self` is the worker): the held weights taken (a host copy in
    the engine's dtype, under the trainer's names), then handed out bucket by bucket."""

    def eddy_take_held(self) -> str:
        """Take the copy; returns '' once taken, else why the weights cannot be given back
        (a reason, not an exception: vLLM's RPC would keep only its text)."""
        runner = self.model_runner
        model = runner.get_model() if callable(getattr(runner, "get_model", None)) \
            else runner.model
        try:
            weights = read_back(model, self.__dict__.get("_eddy_staged"))
        except WeightsNotHeld as refused:
            return str(refused)
        dtype = self.model_config.dtype
        self._eddy_held = {name: t.to("cpu", dtype) for name, t in weights.items()}
        return ""

    def eddy_held_bucket(self, max_bytes: int) -> list[PackedTensor]:
        """The next tensors of the copy, up to `max_bytes` (at least one); [] once all went."""
        held = self.__dict__.get("_eddy_held", {})
        bucket, size = {}, 0
        while held and (not bucket or size + _nbytes(next(iter(held.values()))) <= max_bytes):
            name = next(iter(held))
            bucket[name] = held.pop(name)
            size += _nbytes(bucket[name])
        return pack(bucket)

    def eddy_drop_held(self) -> None:
        self.__dict__.pop("_eddy_held", None)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ---- adapter side -----------------------------------------------------------------------------
async def fetch_held(rpc: Callable[..., Awaitable], expected: frozenset[str] | None,
                     bucket_bytes: int = BUCKET_BYTES) -> dict[str, torch.Tensor]:
    """The worker's held weights, on the host, under exactly the `expected` names (the names a
    weight update brings; None: not checked): a name missing is refused; names the trainer
    never sends (none on the tiny Qwen3) are left out."""
    reason = await rpc("eddy_take_held")
    if reason:
        raise WeightsNotHeld(reason)
    weights: dict[str, torch.Tensor] = {}
    try:
        while bucket := await rpc("eddy_held_bucket", bucket_bytes):
            weights.update(unpack(item) for item in bucket)
    finally:
        await rpc("eddy_drop_held")
    if expected is None:
        return weights
    missing = sorted(expected - set(weights))
    if missing:
        raise WeightsNotHeld(f"the model read back lacks weights the trainer sends: "
                             f"{missing[:3]} ({len(missing)} in all)")
    return {name: weights[name] for name in sorted(expected)}

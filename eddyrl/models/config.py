"""Config section of the policy model, and the start-up checks of a model directory: its files
(config.json, safetensors weights), its tokenizer against the model, and the lengths a run asks
of it."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..validation import did_you_mean

BUILTIN_PREFIX = "builtin:"
ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHAPES = ASSETS / "shapes"  # models' config.json files without weights (`model.shape`)
# At least one of these makes a directory's tokenizer; without any, transformers may build an
# empty one from config.json alone instead of failing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Weights in PyTorch's pickle format: loading them runs whatever code the file holds.
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin",
                  "*.pt", "*.pth", "*.ckpt")
EXPECTED = "config.json and the weights as *.safetensors"
# What the tokenizer round-trips at start-up, rendered by the model's chat template when it has
# one: digits, spaces and arithmetic, which every tokenizer has (the tiny one included).
PROBE_TEXTS = ("1 + 2 = 3", "12 * 34 - 5 = 403")
# Keys of config.json that give the longest sequence the model's positions cover.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    # A Hugging Face model directory, or "builtin:<name>" for a model shipped in eddyrl/assets.
    path: str = "builtin:tiny_warmstart"
    # Weights are loaded from safetensors only. A directory that has them only as PyTorch
    # pickle files (pytorch_model.bin) is refused unless this is true: unpickling runs code the
    # file holds, so set it only for a file you trust (or convert it: save_pretrained writes
    # safetensors).
    allow_pickle_weights: bool = False
    # The model's shape for `eddy plan` and the preflight memory check when `path` is not on
    # this machine (a recipe's placeholder): a shipped shape's name (eddyrl/assets/shapes:
    # Qwen3-4B, ...) or a config.json file. A config.json at `path` wins.
    shape: str | None = None

    def validate(self, prefix: str, check_files: bool = True) -> None:
        """`check_files`: whether `path` must be a model directory on this machine (a run's
        start); False for reading a config without its model (`eddy config show`, `eddy
        plan`)."""
        if self.shape is not None:
            shape_file(self.shape, f"{prefix}.shape")
        if check_files:
            self.resolve(prefix)

    def resolve(self, prefix: str = "model", label: str | None = None) -> str:
        """The model directory on disk; a clear error when it is not a model directory: a
        file, no config.json, no weights, or weights only in pickle format (unless
        `allow_pickle_weights`, with a warning). `label` names the path in errors (default: the
        config key)."""
        label = label or f"config key '{prefix}.path' = {self.path!r}"
        if self.path.startswith(BUILTIN_PREFIX):
            name = self.path[len(BUILTIN_PREFIX):]
            directory = ASSETS / name
            known = sorted(p.name for p in ASSETS.iterdir() if p.is_dir() and p != SHAPES) \
                if ASSETS.is_dir() else []
            if not directory.is_dir():
                raise ConfigError(f"{label}: no built-in "
                                  f"model {name!r}; built-in models: {', '.join(known) or 'none'}")
        else:
            directory = Path(self.path).expanduser()
            if directory.is_file():
                raise ConfigError(f"{label}: is a file; a model directory is expected (a "
                                  f"Hugging Face directory holding {EXPECTED})")
            if not directory.is_dir():
                raise ConfigError(f"{label}: directory does not exist")
        missing = [] if (directory / "config.json").is_file() else ["config.json"]
        missing += _missing_weights(directory, label, self.allow_pickle_weights, prefix)
        if missing:
            raise ConfigError(f"{label}: {directory} has no {' and no '.join(missing)}, so it "
                              f"is not a Hugging Face model directory (expected {EXPECTED})")
        return str(directory)


def shipped_shapes() -> list[str]:
    """The names of the model shapes shipped in eddyrl/assets/shapes (config.json only)."""
    return sorted(p.parent.name for p in SHAPES.glob("*/config.json"))


def shape_file(shape: str, key: str = "model.shape") -> Path:
    """The config.json `shape` names: a shipped shape (case aside), or a file (or a model
    directory holding one); a ConfigError naming `key` and the shipped shapes otherwise."""
    known = {name.lower(): name for name in shipped_shapes()}
    if shape.lower() in known:
        return SHAPES / known[shape.lower()] / "config.json"
    path = Path(shape).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    raise ConfigError(f"config key {key!r} = {shape!r} is neither a shipped shape nor a "
                      f"config.json file; shipped shapes: {', '.join(known.values())}"
                      f"{did_you_mean(shape, list(known.values()))}")


def _missing_weights(directory: Path, label: str, allow_pickle: bool, prefix: str) -> list[str]:
    """What is missing of the directory's safetensors weights: [] when they are all there
    (every shard an index names), else the missing names. Pickle-only weights are refused
    here by name, or accepted with a warning when `allow_pickle`."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{label}: {index} is not a safetensors index (a JSON object "
                              f"with a 'weight_map'): {type(exc).__name__}: {exc}") from None
        return [name for name in shards if not (directory / name).is_file()]
    if any(directory.glob("*.safetensors")):
        return []
    pickled = sorted({p.name for pattern in PICKLE_WEIGHTS for p in directory.glob(pattern)})
    if not pickled:
        return ["*.safetensors"]
    if not allow_pickle:
        raise ConfigError(
            f"{label}: {directory} has its weights only in PyTorch's pickle format "
            f"({', '.join(pickled)}); Eddy loads *.safetensors only, since unpickling runs code "
            "the file holds: convert them (from_pretrained, then save_pretrained writes "
            f"safetensors), or set {prefix}.allow_pickle_weights=true if you trust the file")
    warnings.warn(f"{label}: loading pickle weights ({', '.join(pickled)}) because "
                  f"{prefix}.allow_pickle_weights is true: unpickling runs code the file holds",
                  UserWarning, stacklevel=4)
    return []


def weights_kwargs(model_path: str | Path) -> dict[str, Any]:
    """What `from_pretrained(model_path, ...)` should be given so that weights come from
    safetensors only: `use_safetensors=True` when the directory has them; nothing for a
    directory with pickle weights only, which `ModelConfig.resolve` lets through only with
    `model.allow_pickle_weights`."""
    directory = Path(model_path)
    has = (directory / SAFETENSORS_INDEX).is_file() or any(directory.glob("*.safetensors"))
    return {"use_safetensors": True} if has else {}


def model_json(model_path: str | Path, name: str = "config.json") -> dict[str, Any]:
    """A JSON file of the model directory (config.json, generation_config.json) as a dict;
    {} when the file is absent; a ConfigError naming the file when it does not parse."""
    path = Path(model_path) / name
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise ConfigError(f"model file '{path}' does not load ({type(exc).__name__}: {exc})") \
            from None
    if not isinstance(value, dict):
        raise ConfigError(f"model file '{path}' must hold a JSON object, not "
                          f"{type(value).__name__}")
    return value


def max_positions(model_config: dict[str, Any]) -> tuple[int, str] | None:
    """(the longest sequence the model's positions cover, the config.json key that says so),
    or None when its config.json does not say. A RoPE scaling factor (`rope_scaling` /
    `rope_parameters`, e.g. YaRN) multiplies it."""
    config = model_config.get("text_config") or model_config
    for key in POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            break
    else:
        return None
    for scaling_key in ("rope_scaling", "rope_parameters"):
        scaling = config.get(scaling_key)
        factor = scaling.get("factor") if isinstance(scaling, dict) else None
        if isinstance(factor, (int, float)) and factor > 1 and \
                scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            return int(value * factor), f"{key} x {scaling_key}.factor {factor}"
    return value, key


def load_tokenizer(model_path: str):
    """The tokenizer saved with the model at `model_path`, checked against the model
    (`check_tokenizer`): a ConfigError naming the directory or file when it has no tokenizer,
    one with more tokens than the model's embedding table has rows (ids past it fail deep
    inside a worker), or one whose ids are not the model's. A smaller tokenizer is normal:
    embedding tables are often padded."""
    from transformers import AutoTokenizer

    directory = Path(model_path)
    where = f"model directory '{directory}'"
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "save the model's tokenizer next to it (tokenizer.save_pretrained)")
    try:
        config = json.loads((directory / "config.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # a corrupt config.json or tokenizer file: say which directory
        raise ConfigError(f"{where}: the model's config or tokenizer does not load "
                          f"({type(exc).__name__}: {exc})") from None
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's "
                          f"embedding table has vocab_size = {vocab}; token ids from {vocab} up "
                          "have no embedding, so this tokenizer does not belong to this model")
    check_tokenizer(tokenizer, directory)
    return tokenizer


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def check_tokenizer(tokenizer, model_path: str | Path) -> None:
    """The tokenizer saved at `model_path` is the model's, as far as it can be told without
    running the model; a ConfigError naming the tokenizer file otherwise:

    - its eos and pad tokens have the ids the model's config.json / generation_config.json
      give (a permuted vocabulary moves them; a pad id equal to an eos id is accepted);
    - a few prompts rendered with the model's chat template (plain text without one) encode
      and decode back to the same text, whitespace aside (no unknown tokens, no lost bytes).

    A permutation of ordinary tokens that leaves the special tokens' ids in place cannot be
    told from the files: only the model's outputs would show it."""
    directory = Path(model_path)
    file = next((directory / n for n in TOKENIZER_FILES if (directory / n).is_file()), directory)
    where = f"tokenizer '{file}'"
    declared = {"eos": set(), "pad": set()}
    sources = {"eos": [], "pad": []}
    config = model_json(directory, "config.json")
    for name, values in (("config.json", config),
                         ("config.json text_config", config.get("text_config") or {}),
                         ("generation_config.json",
                          model_json(directory, "generation_config.json"))):
        for kind in declared:
            value = values.get(f"{kind}_token_id") if isinstance(values, dict) else None
            if _ids(value):
                declared[kind] |= _ids(value)
                sources[kind].append(f"{name} {kind}_token_id = {value!r}")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is not None and declared["eos"] and eos not in declared["eos"]:
        raise ConfigError(_mismatch(where, tokenizer, "eos", eos, sources["eos"],
                                    declared["eos"]))
    if pad is not None and declared["pad"] and pad not in declared["pad"] | declared["eos"]:
        raise ConfigError(_mismatch(where, tokenizer, "pad", pad, sources["pad"],
                                    declared["pad"]))
    for text in PROBE_TEXTS:
        _check_round_trip(tokenizer, text, where)


def _mismatch(where: str, tokenizer, kind: str, token_id: int, sources: list[str],
              declared: set[int]) -> str:
    token = getattr(tokenizer, f"{kind}_token")
    there = ", ".join(f"{i} as {tokenizer.convert_ids_to_tokens(i)!r}" for i in sorted(declared)
                      if 0 <= i < len(tokenizer))
    return (f"{where}: its {kind} token {token!r} is id {token_id}, but the model's "
            f"{' and '.join(sources)}" + (f" (the tokenizer reads {there})" if there else "")
            + "; the tokenizer's ids are not the model's (a different or permuted vocabulary): "
            "save the model's own tokenizer next to it")


def _check_round_trip(tokenizer, content: str, where: str) -> None:
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                 add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # every prompt goes through it: say so now
            raise ConfigError(f"{where}: the chat template fails on one user message "
                              f"({type(exc).__name__}: {exc})") from None
    else:
        text = content
    ids = tokenizer.encode(text, add_special_tokens=False)
    back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if "".join(back.split()) != "".join(text.split()):
        raise ConfigError(f"{where}: {text!r} encodes to {len(ids)} tokens that decode to "
                          f"{back!r}, not to the same text; the tokenizer is broken or not the "
                          "model's")

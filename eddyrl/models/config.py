"""Config section of the policy model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

BUILTIN_PREFIX = "builtin:"
ASSETS = Path(__file__).resolve().parents[1] / "assets"
# At least one of these makes a directory's tokenizer; without any, transformers may build an
# empty one from config.json alone instead of failing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    # A Hugging Face model directory, or "builtin:<name>" for a model shipped in eddyrl/assets.
    path: str = "builtin:tiny_warmstart"

    def validate(self, prefix: str) -> None:
        self.resolve(prefix)

    def resolve(self, prefix: str = "model", label: str | None = None) -> str:
        """The model directory on disk; a clear error when it is not a model directory.
        `label` names the path in errors (default: the config key)."""
        label = label or f"config key '{prefix}.path' = {self.path!r}"
        if self.path.startswith(BUILTIN_PREFIX):
            name = self.path[len(BUILTIN_PREFIX):]
            directory = ASSETS / name
            known = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
            if not directory.is_dir():
                raise ConfigError(f"{label}: no built-in "
                                  f"model {name!r}; built-in models: {', '.join(known) or 'none'}")
        else:
            directory = Path(self.path).expanduser()
            if not directory.is_dir():
                raise ConfigError(f"{label}: directory does not exist")
        if not (directory / "config.json").is_file():
            raise ConfigError(f"{label}: {directory} has no "
                              "config.json, so it is not a Hugging Face model directory")
        return str(directory)


def load_tokenizer(model_path: str):
    """The tokenizer saved with the model at `model_path`, checked against the model: a
    ConfigError naming the directory when it has no tokenizer, or one with more tokens than the
    model's embedding table has rows (ids past it fail deep inside a worker). A smaller
    tokenizer is normal: embedding tables are often padded."""
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
    return tokenizer

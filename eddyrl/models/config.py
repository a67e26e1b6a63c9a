"""Config section of the policy model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

BUILTIN_PREFIX = "builtin:"
ASSETS = Path(__file__).resolve().parents[1] / "assets"


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

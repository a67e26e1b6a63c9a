"""One config tree from typed dataclasses, YAML files and `key=value` overrides."""

from .loader import load_config, parse_overrides, read_yaml, to_yaml
from .schema import EddyConfig

__all__ = ["EddyConfig", "load_config", "parse_overrides", "read_yaml", "to_yaml"]

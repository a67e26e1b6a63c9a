"""One config tree from typed dataclasses, YAML files and `key=value` overrides."""

from .bundled_configs import bundled, bundled_names, bundled_root, resolve_config
from .loader import load_config, parse_overrides, read_yaml, to_yaml
from .schema import EddyConfig

__all__ = ["EddyConfig", "bundled", "bundled_names", "bundled_root", "load_config",
           "parse_overrides", "read_yaml", "resolve_config", "to_yaml"]

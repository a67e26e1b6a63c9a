"""Load a config: typed defaults, then a YAML file, then `key=value` overrides, then validation.

Every failure is a `ConfigError` naming the file or key, the bad value and what is allowed; an
unknown key suggests the closest valid one.
"""

from __future__ import annotations

import copy
import functools
import typing
import warnings
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError
from ..validation import check_choice, did_you_mean
from .bundled_configs import resolve_config
from .schema import EddyConfig
from .yaml_aliases import AliasBoundedLoader, AliasExpansionError


def _schema(schema: type = EddyConfig) -> DictConfig:
    """A fresh copy of the root schema's tree: building it from the dataclasses is most of a
    load's time (~30 ms), copying the built one a sixth of it."""
    return copy.deepcopy(_built_schema(schema))


@functools.cache
def _built_schema(schema: type) -> DictConfig:
    return OmegaConf.structured(schema)


def _all_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node.keys():
        full = f"{prefix}{key}"
        keys.append(full)
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            keys.extend(_all_keys(child, full + "."))
    return keys


def _check_keys(tree: Any, schema: DictConfig, prefix: str, source: str) -> None:
    """Reject keys the schema does not have, with the closest valid key. A free-form mapping
    (a `dict` field, e.g. `env.options`) takes any key: its owner checks them."""
    if not isinstance(tree, dict) or schema._metadata.object_type is dict:
        return
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if key not in schema:
            local = did_you_mean(str(key), [str(k) for k in schema.keys()])
            if local:
                local = did_you_mean(full, [f"{prefix}{k}" for k in schema.keys()]) or local
            if not local:  # maybe the right leaf in the wrong section: match on the full key
                local = did_you_mean(full, _all_keys(_schema()))
            allowed = ", ".join(str(k) for k in schema.keys())
            if full == "sim":
                local = (" (the simulated cluster's section: `eddy sim` reads it, a real run "
                         "has none)")
            raise ConfigError(f"unknown config key {full!r} in {source}{local} "
                              f"(valid keys here: {allowed})")
        child = schema._get_node(key)
        choices = _literal_choices(child)
        if choices is not None and isinstance(value, bool) and \
                all(isinstance(c, str) for c in choices):
            # YAML 1.1 reads a bare off / on as a boolean: where that word is a choice
            # (`preflight.memory: off`), it is what was meant
            word = [c for c in choices if c == ("on" if value else "off")]
            value = tree[key] = word[0] if word else value
        if choices is not None and value is not None:
            # as a str field would take it (YAML's bare off is False, taken as 'False'),
            # with the message every choice key gives
            check_choice(full, str(value) if all(isinstance(c, str) for c in choices)
                         else value, choices)
        if isinstance(child, DictConfig):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"config key {full!r} in {source} is a section; expected a "
                                  f"mapping of its keys, got {value!r}")
            _check_keys(value, child, full + ".", source)
        if isinstance(child, ListConfig) and isinstance(value, dict):  # else a bare TypeError
            raise ConfigError(f"config key {full!r} in {source} is a list; expected a list of "
                              f"entries ([...]), got the mapping {value!r}")


# Keys that moved, old -> new. The version window's settings (how far rollout runs ahead of
# training, and how it streams) were spread over `algorithm`, `loop` and `rollout`; they are one
# section, `window`, now. An old key still works, with a warning that names the new one.
RENAMED: dict[str, str] = {
    "algorithm.max_staleness": "window.max_staleness",
    "loop.max_inflight_prompts": "window.max_inflight_prompts",
    "loop.refill": "window.refill",
    "rollout.partial_rollout": "window.partial_rollout",
    "rollout.migrate": "window.migrate",
    "rollout.fill_legacy": "window.fill_legacy",
}


def _move_renamed(tree: dict, source: str) -> dict:
    """`tree` with every old key of `RENAMED` moved to its new place (warning once per key);
    an old and a new key given together are refused by name."""
    for old, new in RENAMED.items():
        old_section, old_leaf = old.split(".")
        section = tree.get(old_section)
        if not isinstance(section, dict) or old_leaf not in section:
            continue
        new_section, new_leaf = new.split(".")
        target = tree.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # reported as a section given a scalar by _check_keys
        if new_leaf in target:
            raise ConfigError(f"config keys {old!r} and {new!r} both given in {source}: {old!r} "
                              f"is the old name of {new!r}; keep only {new!r}")
        warnings.warn(f"config key {old!r} (in {source}) is deprecated; use {new!r}: the "
                      "version window's settings are one section, `window`", FutureWarning,
                      stacklevel=4)
        target[new_leaf] = section.pop(old_leaf)
        if not section:
            del tree[old_section]
    return tree


def _literal_choices(node: Any) -> tuple | None:
    """The allowed values of a `Literal`-typed key, else None."""
    ref_type = getattr(getattr(node, "_metadata", None), "ref_type", None)
    return typing.get_args(ref_type) if typing.get_origin(ref_type) is typing.Literal else None


def _merge(base: DictConfig, tree: dict, source: str) -> DictConfig:
    tree = _move_renamed(tree, source)
    _check_keys(tree, base, "", source)
    try:
        return OmegaConf.merge(base, OmegaConf.create(tree))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(getattr(exc, "msg", exc)).splitlines()[0]
        raise ConfigError(f"config key {key!r} in {source}: {reason}") from None


class _UniqueKeyLoader(AliasBoundedLoader):
    """`yaml.safe_load`, refusing a key given twice in one mapping: YAML does not allow it,
    and PyYAML would silently keep the last value; and a document whose aliases expand it
    too far (`yaml_aliases.py`)."""

    def construct_mapping(self, node, deep=False):
        lines: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                line = key_node.start_mark.line + 1
                if key_node.value in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} is given twice (lines "
                        f"{lines[key_node.value]} and {line})", key_node.start_mark)
                lines[key_node.value] = line
        return super().construct_mapping(node, deep)


def _yaml_text(path: Path, data: bytes) -> str:
    """The text of a config file: UTF-8 (a byte-order mark is dropped); a ConfigError naming
    the file when it is binary (a NUL byte, or bytes that are not UTF-8)."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"config file '{path}' is not a text YAML file: it is UTF-16 (it "
                          "starts with a UTF-16 byte-order mark); save it as UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ConfigError(f"config file '{path}' is not a text YAML file (binary: a NUL byte "
                          f"at byte {nul}); give a UTF-8 YAML file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"config file '{path}' is not a text YAML file (binary: byte "
                          f"0x{data[exc.start]:02x} at byte {exc.start}, line {line}, is not "
                          "UTF-8); give a UTF-8 YAML file") from None


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a directory; give the path of a YAML file "
                          "(or a bundled config's name)")
    if not path.exists():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read ({exc.strerror or exc})") \
            from None
    text = _yaml_text(path, data)
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader)
    except AliasExpansionError as exc:
        raise ConfigError(f"config file '{path}' is refused: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: "
                          f"{getattr(exc, 'problem', exc)}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys, not "
                          f"{type(tree).__name__}")
    return tree


def parse_overrides(overrides: Sequence[str]) -> dict:
    """`a.b=1` strings to a nested dict; values are parsed as YAML scalars (1, 0.5, null, true)."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form key=value "
                              "(e.g. platform=cpu or rollout.engine=hf)")
        try:
            value = yaml.load(raw, Loader=AliasBoundedLoader) if raw != "" else ""
        except AliasExpansionError as exc:
            raise ConfigError(f"override {key!r} is refused: {exc.message(key)}") from None
        except yaml.YAMLError:
            value = raw
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of "
                                  f"{part!r}")
        node[parts[-1]] = value
    return tree


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                schema: type = EddyConfig, folder: str | None = None, *,
                check_files: bool = True) -> EddyConfig:
    """`path`: a YAML file, or the name of a bundled config (`modes/replay`, `sim/dora_64`:
    see `bundled_configs.py`; `folder` is where a bare name is looked up first); a file that
    exists wins. `schema`: the root dataclass, `EddyConfig` or one that extends it (the
    simulator's `sim.config.SimRunConfig` adds its `sim` section). `check_files` False: every
    key and value is checked but `model.path` need not be a model directory here (a recipe
    read without its weights); `eddy train` checks it again at start-up."""
    cfg = _schema(schema)
    path = resolve_config(path, folder)
    if path is not None:
        cfg = _merge(cfg, read_yaml(path), f"'{path}'")
    if overrides:
        cfg = _merge(cfg, parse_overrides(overrides), "the command-line overrides")
    config: EddyConfig = OmegaConf.to_object(cfg)
    config.validate(check_files=check_files)
    return config


def to_yaml(config: EddyConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))

"""YAML aliases in a config: a bomb is refused before anything walks it; ordinary reuse loads.

PyYAML builds an alias as a shared object, so reading a bomb is instant; what came after it
(OmegaConf's merge, `eddy config show`, the saved config.yaml) walks it expanded."""

import re

import pytest

from eddyrl.config import load_config, read_yaml
from eddyrl.config.yaml_aliases import MAX_ALIAS_NODES
from eddyrl.errors import ConfigError

LEVELS = "abcdefghi"


def alias_levels(levels: str = LEVELS) -> list[str]:
    """Billion laughs: each level a list of nine aliases of the one before (nine levels:
    9^9 nodes from 300-odd bytes)."""
    entries = [f"{levels[0]}: &{levels[0]} [x,x,x,x,x,x,x,x,x]"]
    for before, level in zip(levels, levels[1:]):
        entries.append(f"{level}: &{level} [{','.join(['*' + before] * 9)}]")
    return entries


def alias_bomb() -> str:
    """The bomb under env.options, as a config file."""
    return "env:\n  options:\n" + "".join(f"    {entry}\n" for entry in alias_levels())


def test_yaml_alias_bomb_is_refused(tmp_path):
    """Defect 9 of issue 32: a 300-byte alias bomb under env.options hung `eddy config show`
    and `eddy train` past 60 s (read_yaml returned it, OmegaConf's merge then expanded it)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 400
    with pytest.raises(ConfigError) as error:
        read_yaml(bomb)
    message = str(error.value)
    assert f"config file '{bomb}' is refused" in message
    assert "under key 'env.options.i'" in message
    count = int(re.search(r"expand it to ([\d,]+) nodes", message)[1].replace(",", ""))
    assert count > 9 ** 9
    assert f"aliases may add at most {MAX_ALIAS_NODES:,}" in message
    with pytest.raises(ConfigError, match="alias bomb"):  # what `eddy config show` and
        load_config(bomb, check_files=False)               # `eddy train` call


def test_an_alias_bomb_in_an_override_is_refused():
    """`key=value` overrides are YAML too (a flow mapping takes anchors and aliases)."""
    flow = "{" + ", ".join(alias_levels("abcdef")) + "}"
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"env.options={flow}"], check_files=False)
    assert "override 'env.options' is refused" in str(error.value)
    assert "under key 'env.options.f'" in str(error.value)


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    endless = tmp_path / "endless.yaml"
    endless.write_text("env:\n  options:\n    loop: &loop [1, *loop]\n")
    with pytest.raises(ConfigError, match="refers to a node that contains it"):
        read_yaml(endless)


def test_ordinary_aliases_still_load(tmp_path):
    """A recipe reusing a block: an anchored mapping merged (`<<`) and aliased, and a block of
    20 values reused 50 times (1,000 nodes), well below the bound."""
    recipe = tmp_path / "recipe.yaml"
    block = ", ".join(str(n) for n in range(20))
    reuses = ", ".join(["*block"] * 50)
    recipe.write_text(
        "rollout: &sampling\n  temperature: 0.7\n  top_p: 0.9\n"
        "env:\n  options:\n"
        f"    block: &block [{block}]\n    reused: [{reuses}]\n"
        "    eval_sampling: {<<: *sampling, temperature: 0.5}\n")
    config = load_config(recipe, check_files=False)
    assert config.rollout.temperature == 0.7 and config.rollout.top_p == 0.9
    assert config.env.options["reused"] == [list(range(20))] * 50
    assert config.env.options["eval_sampling"] == {"temperature": 0.5, "top_p": 0.9}

"""The version window's settings moved to one section, `window`; the old keys still load,
with a warning that names the new key, and an old and a new key together are refused."""

import pytest

from eddyrl.config import load_config
from eddyrl.config.loader import RENAMED
from eddyrl.errors import ConfigError

VALUES = {"window.max_staleness": 2, "window.max_inflight_prompts": 32,
          "window.refill": "stream", "window.partial_rollout": True,
          "window.migrate": False, "window.fill_legacy": True}


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_an_old_key_loads_into_the_window_section_with_a_warning(old, new):
    with pytest.warns(FutureWarning, match=f"'{old}'.*deprecated; use '{new}'"):
        config = load_config(overrides=[f"{old}={VALUES[new]}"])
    assert getattr(config.window, new.split(".")[1]) == VALUES[new]


def test_old_keys_in_a_yaml_file_load_too(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("algorithm:\n  max_staleness: 1\n  kl_coef: 0.0\nloop:\n  refill: stream\n")
    with pytest.warns(FutureWarning) as warned:
        config = load_config(path)
    named = sorted(str(w.message).split("'")[1] for w in warned)
    assert named == ["algorithm.max_staleness", "loop.refill"]
    assert config.window.max_staleness == 1 and config.window.refill == "stream"
    assert config.algorithm.kl_coef == 0.0


def test_an_old_and_a_new_key_together_are_refused_by_name():
    with pytest.raises(ConfigError, match="'algorithm.max_staleness' and "
                                          "'window.max_staleness' both given"):
        load_config(overrides=["algorithm.max_staleness=1", "window.max_staleness=2"])


def test_the_new_keys_load_without_a_warning(recwarn):
    config = load_config(overrides=[f"{key}={value}" for key, value in VALUES.items()])
    assert config.window.max_staleness == 2
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]

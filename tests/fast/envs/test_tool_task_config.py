"""The tool task's settings, checked at load: the bundled `tool_add_tiny` config file validates,
and a tool task without an environment, an unknown task or a misspelt environment is refused
naming the key. (The tool task's episodes on the tiny model: test_rollout_calculator.py.)"""

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError


def test_the_tool_task_config_file_validates():
    from eddyrl.config import bundled

    path = bundled("tool_add_tiny")
    config = load_config(path)
    assert (config.data.task, config.env.name, config.env.options) == \
        ("tool_add", "calculator", {"syntax": "tiny"})


@pytest.mark.parametrize("overrides, fragment", [
    (["data.task=tool_add"], "env.name"),
    (["data.task=tools"], "'data.task' = 'tools'"),
    (["env.name=calculater"], "did you mean 'calculator'"),
])
def test_tool_task_settings_are_checked_at_load(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(overrides=overrides)

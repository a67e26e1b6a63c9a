"""Issue 34, item 5: a reward function in a file beside the user, `path/to/file.py:function`
(before: only a dotted path; `data.reward_fn=myreward:reward` for a myreward.py in the current
directory failed with ModuleNotFoundError and no hint)."""

import asyncio
import pickle
import sys

import pytest

from eddyrl.errors import ConfigError
from eddyrl.plugins import load_reward_fn

REWARD = "def reward(response, answer):\n    return float(response.strip() == answer)\n"


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    """A reward in `tmp_path/graders/eddy_test_grader.py`; sys.path and sys.modules as they
    were afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "graders"
    folder.mkdir()
    path = folder / "eddy_test_grader.py"
    path.write_text(REWARD)
    yield path
    sys.modules.pop("eddy_test_grader", None)


def test_a_reward_in_a_file_loads_and_pickles_by_reference(reward_file):
    fn = load_reward_fn(f"{reward_file}:reward")
    assert fn("42", "42") == 1.0 and fn("41", "42") == 0.0
    assert pickle.loads(pickle.dumps(fn)) is fn  # what a user-code worker process is sent


def test_a_reward_in_a_file_runs_in_a_worker_process(reward_file):
    from eddyrl.usercode.config import WorkersConfig

    fn = load_reward_fn(f"{reward_file}:reward")
    pool = WorkersConfig(mode="process", workers=1).build(
        "user_code.reward", name="reward", sent=(("data.reward_fn", fn),))

    async def score():
        try:
            return await pool.call(fn, "7", "7")
        finally:
            pool.close()
    assert asyncio.run(score()) == 1.0


def test_a_file_that_is_missing_or_would_shadow_a_module_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ConfigError, match="no such file '.*nowhere.py'"):
        load_reward_fn(f"{tmp_path}/nowhere.py:reward")
    (tmp_path / "json.py").write_text(REWARD)
    with pytest.raises(ConfigError, match="a module named 'json' already comes from .* rename"):
        load_reward_fn(f"{tmp_path}/json.py:reward")
    (tmp_path / "my-grader.py").write_text(REWARD)
    with pytest.raises(ConfigError, match="must be a Python identifier"):
        load_reward_fn(f"{tmp_path}/my-grader.py:reward")


def test_a_module_name_for_a_file_in_the_current_directory_says_how(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    (tmp_path / "eddy_test_local_grader.py").write_text(REWARD)
    with pytest.raises(ConfigError) as error:
        load_reward_fn("eddy_test_local_grader:reward")
    assert ("'eddy_test_local_grader.py' is in the current directory, which `eddy` does not "
            "import from: name the file, "
            "data.reward_fn=./eddy_test_local_grader.py:reward") in str(error.value)

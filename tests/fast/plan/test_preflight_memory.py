"""`preflight.memory`: `eddy train` plans memory before anything exists. A run predicted not to
fit (Qwen3-8B's shape in a stand-in model directory: its config.json and an empty weights file;
on this host its training state alone is over any host's memory) is refused with the numbers
and the fixes, leaves nothing on disk and starts nothing; `warn` warns and goes on to the next
checks (`preflight`, stubbed here to stop the run), `off` plans nothing."""

import shutil
import sys
import warnings

import pytest

from eddyrl.cli import main
from eddyrl.errors import ConfigError
from eddyrl.models.config import SHAPES


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if a runtime, the other preflight checks or the run directory start."""
    import eddyrl.launch as launch
    from eddyrl.run_dir import RunDirectory

    def started(*_, **__):
        raise AssertionError("started after a refused memory plan")

    monkeypatch.setattr(launch, "preflight", started)
    monkeypatch.setattr(RunDirectory, "claim", classmethod(started))


def over(tmp_path, mode: str) -> list[str]:
    model = tmp_path / "model"
    if not model.exists():
        model.mkdir()
        shutil.copy(SHAPES / "Qwen3-8B" / "config.json", model)
        (model / "model.safetensors").write_bytes(b"")  # what loading a config checks
    return [f"model.path={model}", "platform=cpu", f"run_dir={tmp_path / 'run'}",
            "data.max_prompt_tokens=2048", "rollout.max_new_tokens=30000",
            f"preflight.memory={mode}"]


def test_a_run_predicted_not_to_fit_is_refused_before_anything(tmp_path, capsys,
                                                                 nothing_starts):
    ray_before = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    status = main(["train", *over(tmp_path, "check")])
    err = capsys.readouterr().err
    assert status == 2
    assert "predicted not to fit in memory (preflight.memory = check" in err
    assert "DOES NOT FIT" in err and "cheapest fixes" in err
    assert "train.activation_checkpointing=selective" in err
    assert "nothing was started" in err
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no run directory
    assert ("ray" in sys.modules and sys.modules["ray"].is_initialized()) == ray_before


@pytest.fixture
def next_checks(monkeypatch):
    """`preflight`, the checks after the memory plan, stops the run where it is called."""
    import eddyrl.launch as launch

    def reached(config):
        raise ConfigError("the next checks were reached")

    monkeypatch.setattr(launch, "preflight", reached)


def test_warn_warns_and_goes_on_to_the_next_checks(tmp_path, next_checks):
    from eddyrl.config import load_config
    from eddyrl.launch import train

    config = load_config(overrides=over(tmp_path, "warn"))
    with pytest.warns(UserWarning, match="predicted not to fit"), \
            pytest.raises(ConfigError, match="next checks were reached"):
        train(config)


def test_off_plans_nothing(tmp_path, next_checks):
    from eddyrl.config import load_config
    from eddyrl.launch import train

    config = load_config(overrides=over(tmp_path, "off"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(ConfigError, match="next checks were reached"):
            train(config)


def test_the_tiny_default_passes_the_check():
    from eddyrl.config import load_config
    from eddyrl.plan.check import check_memory

    plan = check_memory(load_config(overrides=["platform=cpu"]))
    assert plan is not None and plan.devices[0].label == "host (every process)"

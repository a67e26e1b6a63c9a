"""Issue 34, item 3: a resume goes on with the run's saved settings. Before: after stopping a
`loop.steps=40 checkpoint.every=5` run, the printed `resume=auto run_dir=...` ran to step 100
with `checkpoint.every: 0`, and nothing said that the settings differed."""

from eddyrl.config import load_config, to_yaml
from eddyrl.config.resumed import load_run_config


def saved_run(tmp_path, *overrides):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(load_config(
        overrides=[f"run_dir={run_dir}", *overrides])))
    return run_dir


def test_resume_goes_on_with_the_saved_settings(tmp_path):
    run_dir = saved_run(tmp_path, "loop.steps=40", "checkpoint.every=5")
    config, line = load_run_config(None, ["resume=auto", f"run_dir={run_dir}"])
    assert (config.loop.steps, config.checkpoint.every, config.resume) == (40, 5, "auto")
    assert line == f"resume: going on with the run's saved config ({run_dir}/config.yaml)"


def test_overrides_go_on_top_and_are_named(tmp_path):
    run_dir = saved_run(tmp_path, "loop.steps=40", "checkpoint.every=5")
    config, line = load_run_config(None, ["resume=auto", f"run_dir={run_dir}",
                                          "loop.steps=60"])
    assert (config.loop.steps, config.checkpoint.every) == (60, 5)
    assert line.endswith("; changed by the command line: loop.steps 40 -> 60")


def test_a_config_file_given_as_well_is_used_and_its_differences_named(tmp_path):
    run_dir = saved_run(tmp_path, "loop.steps=40", "checkpoint.every=5")
    config, line = load_run_config("modes/replay", ["resume=auto", f"run_dir={run_dir}",
                                                    "loop.steps=40"])
    assert config.checkpoint.every == 0  # the file's (the default), as given
    assert line.startswith("resume: config 'modes/replay' differs from the run's saved config")
    assert "checkpoint.every 5 -> 0" in line


def test_without_resume_or_a_saved_config_nothing_changes(tmp_path):
    run_dir = saved_run(tmp_path, "loop.steps=40")
    config, line = load_run_config(None, [f"run_dir={run_dir}"])
    assert config.loop.steps == load_config().loop.steps and line is None
    config, line = load_run_config(None, ["resume=auto", f"run_dir={tmp_path / 'fresh'}"])
    assert line is None


def test_the_platform_is_resolved_anew_not_taken_from_the_saved_config(tmp_path):
    """The saved config records the platform `auto` found (`platform: example`); a resume
    resolves it on this machine, and the checkpoint's check refuses a silent move
    (tests/integration/hal/test_plugin_train.py); one named on the command line is kept."""
    run_dir = saved_run(tmp_path, "platform=cpu", "train.platform=cpu")
    config, line = load_run_config(None, ["resume=auto", f"run_dir={run_dir}"])
    assert (config.platform, config.train.platform) == ("auto", None)
    assert "changed by the command line" not in line
    config, _ = load_run_config(None, ["resume=auto", f"run_dir={run_dir}", "platform=cpu"])
    assert config.platform == "cpu"

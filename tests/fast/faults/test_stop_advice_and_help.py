"""What `eddy train` tells the user, checked without a run: `eddy train --help` says what the
arguments are (issue 19), and the advice in the last line after a stop is true in each case
(issue 32): it asks for checkpoint.every only where it is not set, and never recommends a
resume that would be refused. (Stopping a real run with a signal: test_stop_signals.py.)"""

import pytest

from eddyrl import resume
from eddyrl.cli import main
from eddyrl.errors import ConfigError


def test_train_help_names_the_config_overrides_config_show_and_the_modes(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for text in ("eddy train [-h] [CONFIG] [KEY=VALUE ...]", "a YAML file",
                 "bundled config", "KEY=VALUE", "eddy config show", "modes/<name>",
                 "replay", "multiversion", "resume=auto", "tiny_cpu"):
        assert text in shown, (text, shown)


# -- the advice after a stop (issue 32): true in each case ------------------------------------

def _advice(run_dir, every=0):
    """The second half of the CLI's last line after a stop (or a lost worker, a full disk)."""
    from types import SimpleNamespace

    from eddyrl.cli_train import _how_to_go_on

    return _how_to_go_on(SimpleNamespace(run_dir=str(run_dir),
                                         checkpoint=SimpleNamespace(every=every)))


def test_stop_advice_asks_for_checkpoint_every_only_where_it_is_not_set(tmp_path):
    """Before: "set checkpoint.every=N to make a run resumable" even with checkpoint.every=5
    set (a stop before step 5)."""
    set_advice = _advice(tmp_path, every=5)
    assert "set checkpoint.every" not in set_advice, set_advice
    assert set_advice.startswith("no checkpoint was written yet (checkpoint.every=5: the "
                                 "first comes after step 5)"), set_advice
    assert "resume=auto" not in set_advice and "another run_dir" in set_advice, set_advice
    unset_advice = _advice(tmp_path, every=0)
    assert "set checkpoint.every=N" in unset_advice, unset_advice


def test_stop_advice_never_recommends_a_resume_that_would_be_refused(tmp_path, caplog):
    """Before: "resume with resume=auto ... (its newest checkpoint is step 2)" for a run whose
    only checkpoint is corrupt, where resume=auto is then refused; and "step 3" where the
    newest is corrupt and resume=auto goes on from step 2."""
    from run_dir_cases import corrupt, metrics, write

    metrics(tmp_path, [1, 2])
    corrupt(write(tmp_path, 2))
    with pytest.raises(ConfigError) as refused:
        resume.find("auto", tmp_path)
    advice = _advice(tmp_path, every=1)
    assert advice == f"resume=auto would be refused here: {refused.value}", advice

    good = tmp_path / "good"
    good.mkdir()
    metrics(good, [1, 2, 3])
    write(good, 2)
    corrupt(write(good, 3))
    caplog.clear()
    advice = _advice(good, every=1)
    assert advice == (f"resume with resume=auto run_dir={good} (its newest good checkpoint is "
                      "step 2)"), advice
    assert not caplog.records  # the line says it all: no warning about step 3 before it
    assert resume.find("auto", good).step == 2  # what the advice promises

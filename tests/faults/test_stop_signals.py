"""Stopping `eddy train` (issue 19): Ctrl-C printed a 45-line CancelledError/KeyboardInterrupt
traceback, SIGTERM Ray's C++ stack dump and rc 134. Both now stop the run cleanly, leave a
resumable run directory, and end with one line: where it stopped and how to go on, exit status
130 / 143. And `eddy train --help` says what the arguments are.

Issue 32: SIGTERM and SIGHUP stop the default in-process run the same way (they killed it on
the spot, leaving a rendezvous directory), and the advice in that line is true in each case."""

import signal

import pytest

from eddyrl import resume
from eddyrl.cli import main
from eddyrl.errors import ConfigError

from . import eddy_process as run


@pytest.mark.slow
# Ctrl-C on the default run (one process: cluster.runtime auto is local), SIGTERM on Ray's
@pytest.mark.parametrize("signum, status, runtime", [(signal.SIGINT, 130, "auto"),
                                                     (signal.SIGTERM, 143, "ray")])
def test_a_signal_stops_the_run_with_one_line_and_leaves_it_resumable(tiny_model_dir, tmp_path,
                                                                      signum, status, runtime):
    run_dir = tmp_path / "run"
    with run.running(tiny_model_dir, run_dir,
                     overrides=(f"cluster.runtime={runtime}",)) as (driver, processes):
        driver.send_signal(signum)
        rc = run.finish(driver, run_dir)
        err = run.stderr_of(run_dir)
        assert rc == status, err[-3000:]
        assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("eddy: stopped at step ") and f"({signum.name})" in last, last
        assert "resume with resume=auto" in last and str(run_dir) in last, last
        point = resume.find("auto", run_dir)  # what the line promises: a checkpoint to go on
        assert point is not None and f"step {point.step})" in last, last
        assert not run.wait_gone(processes, 30)  # the run's processes (Ray's) went with it


def test_train_help_names_the_config_overrides_config_show_and_the_modes(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for text in ("eddy train [-h] [CONFIG] [KEY=VALUE ...]", "a YAML file",
                 "bundled config", "KEY=VALUE", "eddy config show", "modes/<name>",
                 "replay", "multiversion", "resume=auto", "tiny_cpu"):
        assert text in shown, (text, shown)


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_stop_the_local_run_as_ctrl_c_does(tiny_model_dir, tmp_path, signum,
                                                              status):
    """Issue 32: on the default (in-process) runtime SIGTERM and SIGHUP killed the run on the
    spot: no "stopped at step N" line, and a `rendezvous-*` directory left in the run
    directory. Only the Ray runtime set the handler; now every runtime does."""
    run_dir = tmp_path / "run"
    with run.running(tiny_model_dir, run_dir, overrides=("cluster.runtime=local",)) as (
            driver, _):
        driver.send_signal(signum)
        rc = run.finish(driver, run_dir)
        err = run.stderr_of(run_dir)
        assert rc == status, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("eddy: stopped at step ") and f"({signum.name})" in last, last
        point = resume.find("auto", run_dir)
        assert f"resume with resume=auto run_dir={run_dir} " in last, last
        assert f"step {point.step})" in last, last
        assert not list(run_dir.glob("rendezvous-*"))  # the trainer group's files went too


# -- the advice after a stop (issue 32): true in each case ------------------------------------

def _advice(run_dir, every=0):
    """The second half of the CLI's last line after a stop (or a lost worker, a full disk)."""
    from types import SimpleNamespace

    from eddyrl.cli import _how_to_go_on

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
    from .test_run_directory import corrupt, metrics, write

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

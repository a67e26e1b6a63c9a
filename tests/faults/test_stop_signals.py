"""Stopping `eddy train` (issue 19): Ctrl-C printed a 45-line CancelledError/KeyboardInterrupt
traceback, SIGTERM Ray's C++ stack dump and rc 134. Both now stop the run cleanly, leave a
resumable run directory, and end with one line: where it stopped and how to go on, exit status
130 / 143. And `eddy train --help` says what the arguments are."""

import signal

import pytest

from eddyrl import resume
from eddyrl.cli import main

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

"""Stopping `eddy train` (issue 19): Ctrl-C printed a 45-line CancelledError/KeyboardInterrupt
traceback, SIGTERM Ray's C++ stack dump and rc 134. Both now stop the run cleanly, leave a
resumable run directory, and end with one line: where it stopped and how to go on, exit status
130 / 143.

Issue 32: SIGTERM and SIGHUP stop the default in-process run the same way (they killed it on
the spot, leaving a rendezvous directory). (`eddy train --help`, and the advice in that last
line being true in each case, checked without a run: test_stop_advice_and_help.py.)"""

import signal

import pytest

from eddyrl import resume

import eddy_process as run


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

"""Issue 32's run-directory defect 6 (a 128-case fault probe), with other processes: the lock is
the directory's, not a name in it. Deleting `.eddy.lock` lets no second run in, and a child
forked from a run does not keep the directory locked after the run ends. Each test's
docstring says what happened before. (The other defects, on files alone:
test_run_directory_ownership.py.)"""

import logging
import os
import signal
import subprocess
import sys

import pytest

from eddyrl.errors import ConfigError
from eddyrl.run_dir import LOCK, RunDirectory

HOLDER = ("import sys; from eddyrl.run_dir import RunDirectory; "
          "RunDirectory.claim(sys.argv[1]); print('held', flush=True); sys.stdin.read()")


def test_deleting_the_lock_file_lets_no_second_run_in(tmp_path):
    """Before: `rm R/.eddy.lock` during run A let `eddy train run_dir=R resume=auto` in, which
    retired A's newest checkpoints and its final model and cut its metrics."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        (tmp_path / LOCK).unlink()
        with pytest.raises(ConfigError, match="in use by another run"):
            RunDirectory.claim(tmp_path)
    finally:
        holder.stdin.close()
        holder.wait()
    RunDirectory.claim(tmp_path).release()  # the holder ended: free again


# The child says so once its fork hooks have run (os.fork returns in the child after them):
# before that it holds the inherited descriptor, however briefly. Each line is one write: with
# PYTHONUNBUFFERED, print() writes the text and the newline apart, and the two processes'
# lines could interleave ("1234child").
FORKER = ("import os, sys\nfrom eddyrl.run_dir import RunDirectory\n"
          "RunDirectory.claim(sys.argv[1])\npid = os.fork()\n"
          "if pid == 0:\n    os.write(1, b'child\\n')\n    sys.stdin.read()\n    os._exit(0)\n"
          "os.write(1, f'{pid}\\n'.encode())\nos._exit(0)\n")


def test_a_forked_child_does_not_keep_the_lock_after_the_run_ends(tmp_path, caplog):
    """A flock belongs to the open file description a fork shares: a user-code worker forked
    from the run would keep the directory locked after the run died."""
    run = subprocess.Popen([sys.executable, "-c", FORKER, str(tmp_path)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = {run.stdout.readline().strip(), run.stdout.readline().strip()}
    assert "child" in lines, lines  # its hooks have run
    (child,) = (int(line) for line in lines if line != "child")
    try:
        run.wait(timeout=120)
        with caplog.at_level(logging.WARNING):
            RunDirectory.claim(tmp_path).release()  # the child lives on; the lock went
        assert "ended without releasing" in caplog.text
    finally:
        os.kill(child, signal.SIGKILL)
        run.stdin.close()

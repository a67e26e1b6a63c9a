"""A full disk during a run (issue 32): in-process it ended in a 99-line traceback; on Ray in
"CheckpointException" with no word of ENOSPC, and worker_errors.log, on the same full disk,
stayed empty. Now a full disk (ENOSPC) or quota (EDQUOT), however it was wrapped, ends the run
with one line: that the disk is full, where, and the checkpoint to go on from; the traceback a
worker_errors.log cannot take goes to stderr. The disk is filled by an OSError(ENOSPC) raised
where the write would fail. (Each way of wrapping it, found: test_disk_full_wrapped.py.)"""

import asyncio
import errno
import os
from types import SimpleNamespace

import pytest

from eddyrl.cli import main

from disk_full_cases import ENOSPC, checkpoint_exception
from local_ray import bare_ray, bare_runtime  # noqa: F401  (fixtures: RayCalls, no workers)


def test_a_full_disk_in_process_ends_with_one_line(tiny_model_dir, tmp_path, monkeypatch,
                                                   capsys):
    """The second checkpoint's write fails (the in-process runtime, a real run): before, the
    CheckpointException's traceback; now one line naming ENOSPC and the step-1 checkpoint."""
    from eddyrl.engines.training import fsdp_checkpoint

    saves = []

    def save_rng(*args):
        saves.append(args)
        if len(saves) == 2:
            raise checkpoint_exception(ENOSPC)
        return real_save_rng(*args)

    real_save_rng = fsdp_checkpoint.save_rng
    monkeypatch.setattr(fsdp_checkpoint, "save_rng", save_rng)
    run_dir = tmp_path / "run"
    rc = main(["train", f"model.path={tiny_model_dir}", f"run_dir={run_dir}", "loop.steps=3",
               "checkpoint.every=1", "loop.batch_prompts=2", "loop.eval_every=0",
               "rollout.n_samples=2", "rollout.max_new_tokens=8", "data.train_size=16",
               "data.eval_size=2", "cluster.runtime=local"])
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [row for row in err.splitlines() if row.startswith("eddy: error:")]
    assert line == (f"eddy: error: the disk is full (ENOSPC: No space left on device) writing "
                    f"in run_dir '{run_dir}'; free space there (or choose a run_dir on a disk "
                    f"with room); resume with resume=auto run_dir={run_dir} (its newest good "
                    "checkpoint is step 1)"), line


def _full_disk_actor():
    """An actor whose save fails as torch.distributed.checkpoint's does on a full disk. Made in
    a function: Ray's workers get the class itself, not this module's name."""
    import ray

    class Saving:
        def save(self, path: str) -> None:  # `checkpoint_exception`, here: not importable
            from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as exc:
                raise CheckpointException("save failed", {0: _wrap_exception(exc)}) from None

    return ray.remote(num_cpus=0.1)(Saving).remote()


def test_a_full_disk_on_ray_names_enospc_and_its_traceback_goes_to_stderr(
        bare_runtime, monkeypatch, capsys, tmp_path):  # noqa: F811
    """Before: "trainer rank 0 failed during save: CheckpointException ..." with no ENOSPC, and
    nothing in worker_errors.log (on the full disk) nor anywhere else."""
    import ray

    from eddyrl import cli_train
    from eddyrl.errors import EddyError, WorkerCallError
    from eddyrl.runtime.ray import calls as ray_calls

    append = ray_calls.open_append

    def full_open(path):
        if str(path) == str(bare_runtime.error_log):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return append(path)

    monkeypatch.setattr(ray_calls, "open_append", full_open)
    actor = _full_disk_actor()
    with pytest.raises(WorkerCallError) as raised:
        asyncio.run(bare_runtime.call("trainer rank 0", "save", actor.save.remote("/x")))
    ray.kill(actor)
    message = str(raised.value)
    assert message.startswith("trainer rank 0 failed during save: OSError: [Errno 28] No space "
                              "left on device (leading to "), message
    assert message.endswith("(traceback above, on stderr)"), message
    err = capsys.readouterr().err
    assert f"could not be written: [Errno 28] No space left on device: '{bare_runtime.error_log}'" \
        in err and "CheckpointException" in err, err  # the whole of it, where it can be read
    config = SimpleNamespace(run_dir=str(tmp_path), checkpoint=SimpleNamespace(every=1))
    with pytest.raises(EddyError) as line:  # what `eddy train` then prints, one line
        cli_train._raise_as_one_line(raised.value, config)
    assert str(line.value).startswith("the disk is full (ENOSPC: No space left on device) "
                                      f"writing in run_dir '{tmp_path}'; free space there"), \
        str(line.value)

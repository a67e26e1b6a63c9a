"""A failure inside a worker names its cause first (issue 19), on a local Ray, with actors that
raise: a save that fails on a full disk starts with the OSError (its whole traceback in
worker_errors.log), and a replacement rollout worker that cannot start (a module not installed)
is reported with that reason, once. (The same cause lines from Ray's exception texts alone:
test_worker_errors.py.)"""

import asyncio
import errno
import os

import pytest

from local_ray import bare_ray, bare_runtime  # noqa: F401  (fixtures: RayCalls, no workers)


def _failing_actor(**options):
    """An actor whose save fails on a full disk, or whose start fails on a missing module.
    Made in a function: Ray's workers then get the class itself, not this test module's name
    (they cannot import it)."""
    import ray

    class Failing:
        def __init__(self, start_fails: bool = False) -> None:
            if start_fails:
                import vllm_is_not_installed_here  # noqa: F401

        def save(self, path: str) -> None:
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            except OSError as exc:
                raise RuntimeError("saving failed") from exc

        def stats(self) -> int:
            return 0

    return ray.remote(num_cpus=0.1)(Failing).remote(**options)


def test_a_worker_error_on_ray_starts_with_its_cause(bare_runtime):
    import ray

    from eddyrl.errors import WorkerCallError

    runtime = bare_runtime
    actor = _failing_actor()
    with pytest.raises(WorkerCallError) as raised:
        asyncio.run(runtime.call("trainer rank 0", "save to /runs/x", actor.save.remote("/x")))
    message = str(raised.value)
    assert message.startswith("trainer rank 0 failed during save to /runs/x: OSError: [Errno 28] "
                              "No space left on device: '/x' (leading to RuntimeError: saving "
                              "failed)"), message
    assert "\n" not in message and f"traceback: {runtime.error_log}" in message
    assert "RuntimeError: saving failed" in runtime.error_log.read_text()  # the whole of it
    assert isinstance(raised.value.__cause__, ray.exceptions.RayTaskError)  # and in the chain
    ray.kill(actor)


def test_a_replacement_that_cannot_start_is_reported_once_with_why(bare_runtime):
    from eddyrl.errors import WorkerCallError
    from eddyrl.runtime.ray.rollout_actors import PublishedWeights, RolloutActors

    started = []

    def new_worker(index, incarnation):
        started.append(incarnation)
        return _failing_actor(start_fails=True)

    # the replacement never starts: the weight channel (reconnect, send_weights) is not reached
    actors = RolloutActors([_failing_actor()], new_worker, bare_runtime, PublishedWeights(),
                           reconnect=None, send_weights=None)
    with pytest.raises(WorkerCallError) as raised:
        asyncio.run(actors.replace_worker(0))
    assert str(raised.value).startswith(
        "rollout worker 0 (replacement 1 of 3) failed during start-up: ModuleNotFoundError: No "
        "module named 'vllm_is_not_installed_here' (raised as the actor started)"), raised.value
    assert started == [1]  # not tried again: a new process would fail the same way

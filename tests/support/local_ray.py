"""Shared by the tests on a local Ray: `bare_runtime` (worker errors, a full disk), a
RayRuntime's calls with no workers of its own, on `bare_ray`; `kept_ray`, one Ray for a
module's in-process runs (the e2e runs). Import a fixture into a test module to use it."""

import pytest


@pytest.fixture(scope="module")
def bare_ray():
    """A local Ray started as a run starts it, one for the module's `bare_runtime` tests (each
    kills or leaves only actors of its own; Ray's start is seconds)."""
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime.ray import start_ray, stop_ray

    yield start_ray(runtime_settings(load_config(overrides=["platform=cpu"])))
    stop_ray()


@pytest.fixture
def bare_runtime(bare_ray, tmp_path):
    """A RayRuntime's calls (`RayCalls`) with no workers of its own, on the module's local Ray
    (`bare_ray`: import both): its calls, errors and (with `RolloutActors`) replacement logic."""
    from eddyrl.runtime.ray.calls import RayCalls

    return RayCalls(bare_ray, 120.0, tmp_path / "worker_errors.log")


@pytest.fixture(scope="module")
def kept_ray():
    """One local Ray for the in-process runs of a test module. Ray's own start is paid once
    (5-20 s on the 2-core machine, most of a short run's wall time beside its actors'): the
    first run's `start_ray` starts it, each run's `stop_ray` leaves it up (`ray.shutdown` does
    nothing until the module ends, as tests/integration/project/test_e2e_resume.py keeps it
    for its resume) and the next run's `start_ray` goes on with it. Each run still starts and
    removes its own actors and placement groups, in a namespace of its own, so runs share no
    worker. A run starting and stopping its Ray is tested where that is the subject:
    tests/faults/test_ray_lifecycle.py, tests/integration/project/test_security.py."""
    import ray

    from eddyrl.runtime.ray import stop_ray

    patch = pytest.MonkeyPatch()
    patch.setattr(ray, "shutdown", lambda *args, **kwargs: None)
    try:
        yield
    finally:
        patch.undo()
        stop_ray()

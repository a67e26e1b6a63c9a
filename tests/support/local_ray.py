"""Shared by the fault tests on a local Ray (worker errors, a full disk): `bare_runtime`, a
RayRuntime's calls with no workers of its own. Import the fixture into a test module to use it."""

import pytest


@pytest.fixture
def bare_runtime(tmp_path):
    """A RayRuntime's calls (`RayCalls`) with no workers of its own, on a local Ray started as
    a run starts it: its calls, errors and (with `RolloutActors`) replacement logic."""
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime.ray import start_ray
    from eddyrl.runtime.ray.calls import RayCalls

    session = start_ray(runtime_settings(load_config(overrides=["platform=cpu"])))
    yield RayCalls(session, 120.0, tmp_path / "worker_errors.log")
    from eddyrl.runtime.ray import stop_ray

    stop_ray()

"""Starting and stopping the Ray a run uses. With no `cluster.address`, Ray starts on this
machine bound to loopback (token authentication stays on), its processes watched and reaped by
a `LocalRaySession` (`session.py`) that this module holds while it runs; with an address, Eddy
joins that cluster (`connect.py`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ...errors import ConfigError, EddyError
from ...stopping import stop_signals_as_interrupt
from ..devices import node_resources
from . import connect
from .session import LocalRaySession

if TYPE_CHECKING:
    from ..settings import RuntimeSettings


_session: LocalRaySession | None = None  # the local Ray this process started, while it runs


def start_ray(settings: RuntimeSettings) -> LocalRaySession | None:
    """Local mode: every Ray server (GCS, raylet, object manager, workers' gRPC, agents, metrics)
    listens on loopback only, and Ray's token authentication stays on (its default for a local
    `ray.init`; RAY_AUTH_MODE is left alone) with a token of this session's own; its processes
    are reaped when the driver stops or dies, and its GCS and raylet watched
    (`session.py`); it declares the devices of both roles' platforms. Returns that
    session (None when joining a cluster)."""
    global _session
    cluster = settings.cluster
    if cluster.address is None:
        if os.environ.get("RAY_ADDRESS"):
            # ray.init would join it, and refuse this call's local settings with a traceback
            raise ConfigError(f"RAY_ADDRESS is set ({os.environ['RAY_ADDRESS']!r}) but "
                              "cluster.address is not: a run without cluster.address starts "
                              "its own Ray on this machine. To join that cluster set "
                              "cluster.address=auto; to run locally, unset RAY_ADDRESS")
        # Ray 2.60 binds its servers to the node IP when that is loopback and to the wildcard
        # (or the machine's address) otherwise. `ray.init` replaces a loopback
        # `_node_ip_address` with the machine's routable address unless this variable is 0,
        # which Ray reads once, when first imported; set before that, it also reaches the
        # processes Ray starts.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        # Ray starts its workers at niceness 15 (background work by default); Eddy's workers
        # are the run itself. At 15, any busy process beside the run takes nearly all the CPU
        # from them: on the 2-core VM with two busy loops, a test suite's e2e runs stalled.
        # A user's own setting wins.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # When the driver connects, Ray's raylet starts a Python worker per CPU, ahead of any
        # task. A run's work is its actors, each started for itself, so on a small machine
        # those idle workers only take CPU from the run's start: with them a 2-step e2e run
        # on the 2-core VM took 1.14x the CPU (1.14-1.17 over 3 pairs); its wall time, 1.09x
        # in the median, was within the machine's noise (0.96-1.25).
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    else:
        connect.prepare_join(cluster.address)
    import ray

    if ray.is_initialized():
        return _session
    if _session is not None:  # shut down by someone else since: what is left of it goes
        _session.close()
        _session = None
    if cluster.address is None:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # the same, where Ray was imported earlier
        session = LocalRaySession()
        session.private_token()
        try:
            # address="local": a Ray of its own even when a cluster started with `ray start`
            # runs on this machine (without it, ray.init joins that one, found through
            # /tmp/ray/ray_current_cluster, and refuses num_cpus with a traceback)
            # A plug-in platform's devices are declared as Ray resources (Ray counts only
            # the accelerators it knows): without them its actors could never be placed.
            ray.init(address="local", num_cpus=cluster.num_cpus or os.cpu_count(),
                     resources=node_resources(settings.platforms) or None,
                     include_dashboard=False,
                     _node_ip_address="127.0.0.1",
                     logging_level="WARNING", log_to_driver=True, configure_logging=True)
        except BaseException:
            session.close()
            raise
        node_ip = ray.util.get_node_ip_address()
        if node_ip != "127.0.0.1":  # fail closed: never leave Ray listening on the network
            ray.shutdown()
            session.close()
            raise EddyError(f"local Ray started on {node_ip} instead of loopback (127.0.0.1); "
                            "its servers would accept connections from the network")
        session.started()
        _session = session
    else:
        connect.join(cluster.address)
    stop_signals_as_interrupt()  # again after ray.init, which sets its own (a stack dump, an abort)
    return _session


def stop_ray() -> None:
    """Shut the local Ray down; then its session's leftovers are killed and its token removed
    (not while Ray is still up: a test may keep one Ray for two runs)."""
    global _session
    import ray

    ray.shutdown()
    if not ray.is_initialized() and _session is not None:
        _session.close()
        _session = None

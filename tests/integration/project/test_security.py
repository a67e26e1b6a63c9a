"""The project's rule for the servers it starts, checked on a local Ray: they listen on loopback
only, and Ray's token authentication is on. Ray is started as the runtime starts it
(`start_ray`), with one actor; then every socket of every process of that Ray session is read."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile
import time

import psutil

# Imported before `start_ray` on purpose: Ray reads part of its environment when first imported,
# and the runtime must keep Ray on loopback even when something imported it earlier.
import ray

LATE_SERVERS_S = 3.0  # agents open some servers a moment after `ray.init` returns


@ray.remote(num_cpus=0.1)
class _Probe:
    def pid(self) -> int:
        return os.getpid()


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    # gRPC listens on dual-stack sockets: 127.0.0.1 there reads ::ffff:127.0.0.1
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _servers(pid: int) -> set[tuple[str, str, int]]:
    """(protocol, address, port) of what `pid` listens on: TCP listeners, unconnected UDP."""
    try:
        connections = psutil.Process(pid).net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return set()
    return {("udp" if c.type == socket.SOCK_DGRAM else "tcp", c.laddr.ip, c.laddr.port)
            for c in connections
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)}


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:
        return "(exited)"


def _session_pids(before: set[int], actor_pid: int) -> set[int]:
    """This Ray session's processes: everything the test process started since `before` (GCS,
    raylet, monitors; under the raylet, workers and agents), the actor, and, as a cross-check,
    the processes Ray lists for its node, with their descendants."""
    pids = (_descendants(os.getpid()) - before) | {actor_pid}
    node = getattr(ray._private.worker, "_global_node", None)
    for infos in getattr(node, "all_processes", {}).values():
        for info in infos:
            pids |= {info.process.pid} | _descendants(info.process.pid)
    return pids


def test_local_ray_listens_on_loopback_only_with_token_auth(monkeypatch):
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime.ray import start_ray

    if ray.is_initialized():
        ray.shutdown()  # the session checked is one that start_ray starts
    # A cluster someone started with `ray start` on this machine (its address file, pointing
    # at a port nothing listens on): a run without cluster.address still starts its own Ray
    # (once, ray.init joined that one and refused num_cpus). A Ray temp dir of the test's own,
    # short: Ray's socket paths must fit in 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="eddy-ray-")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    os.makedirs(os.path.join(ray_tmp, "ray"))
    with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as file:
        file.write("127.0.0.1:9")
    me = os.getpid()
    children_before = _descendants(me)
    own_before = _servers(me)  # the test process's own servers from before Ray, if any
    start_ray(runtime_settings(load_config(overrides=["platform=cpu"])))
    try:
        actor = _Probe.remote()  # held: an actor without a handle ends, and its process too
        actor_pid = ray.get(actor.pid.remote(), timeout=60)
        assert actor_pid in _descendants(me), "the actor is not under this Ray session"
        # Ray's default niceness for workers is 15; the run's workers must not yield the CPU to
        # whatever else the machine runs
        assert psutil.Process(actor_pid).nice() == os.nice(0), "Ray workers run niced"
        seen: dict[tuple[int, str, str, int], str] = {}
        deadline = time.monotonic() + LATE_SERVERS_S
        while True:
            for pid in _session_pids(children_before, actor_pid) | {me}:
                for server in _servers(pid) - (own_before if pid == me else set()):
                    seen.setdefault((pid, *server), _name(pid))
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)

        gcs_port = int(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])
        assert any(port == gcs_port for (_, _, _, port) in seen), \
            f"the GCS's port {gcs_port} was not among the sockets read: {sorted(seen)}"
        assert any(pid == actor_pid for (pid, *_) in seen), \
            f"the actor's server (pid {actor_pid}) was not read: {sorted(seen)}"
        offenders = [f"{name} (pid {pid}) {protocol} {f'[{ip}]' if ':' in ip else ip}:{port}"
                     for (pid, protocol, ip, port), name in sorted(seen.items())
                     if not _is_loopback(ip)]
        assert not offenders, ("Ray servers listening beyond loopback:\n  "
                               + "\n  ".join(offenders))

        # Token authentication: a GCS call without the token is refused.
        with grpc.insecure_channel(ray.get_runtime_context().gcs_address) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            try:
                stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
            else:
                raise AssertionError("the GCS answered a call without the auth token: token "
                                     "authentication is off")
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)

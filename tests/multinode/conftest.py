"""Fixtures for multi-node tests: two hosts (network + mount namespaces) and a Ray cluster
across them (`hosts.py`). Each skips, with the reason, where namespaces cannot be made (not
root, `ip`/`unshare`/`nsenter` missing, `ip netns add` refused): probed once a session.

- `two_hosts`: hosts A and B, no Ray (`hosts.a.run(...)`, `.popen`, `.python`, `.path`).
- `ray_cluster_factory`: `make(num_cpus={"A": 1, "B": 2}, resources={"B": {"x": 1}})` builds
  fresh hosts and starts a Ray head on A and a worker node on B (`node_env={"B": {...}}`: an
  environment for B's node and its workers); all of it ends with the test.
- `ray_two_hosts`: one cluster for a module's tests (1 CPU a host, resources host_a / host_b,
  unless the module sets `multinode_cluster`).

Teardown runs however the test ends, kills only what the hosts ran, and fails the test's
teardown if anything is left.
"""

from __future__ import annotations

import pytest

from .hosts import RayCluster, TwoHosts, probe


@pytest.fixture(scope="session")
def multinode_available() -> None:
    reason = probe()
    if reason is not None:
        pytest.skip(f"multi-node tests need network namespaces: {reason}")


@pytest.fixture
def two_hosts(multinode_available):
    with TwoHosts() as hosts:
        yield hosts


@pytest.fixture
def ray_cluster_factory(multinode_available):
    made: list[TwoHosts] = []

    def make(**cluster_options) -> RayCluster:
        hosts = TwoHosts()
        made.append(hosts)  # before start: a failed start is cleaned up too
        hosts.start()
        return RayCluster(hosts, **cluster_options).start()

    try:
        yield make
    finally:
        errors = []
        for hosts in made:
            try:
                hosts.close()
            except Exception as error:  # close the others anyway
                errors.append(error)
        if errors:
            raise errors[0]


@pytest.fixture(scope="module")
def ray_two_hosts(multinode_available, request):
    """One cluster for the module; a module sets its options (RayCluster's keywords) with
    `multinode_cluster = {"num_cpus": {"A": 2}, "resources": {"B": {"only_b": 1}}}`."""
    options = getattr(request.module, "multinode_cluster", {})
    with TwoHosts() as hosts:
        yield RayCluster(hosts, **options).start()

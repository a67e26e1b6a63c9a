"""Which device each actor of a node takes (runtime/devices.py), without Ray: the claims, their
release, the binding a platform receives, and the resources a local Ray declares."""

import os
import tempfile

import pytest

from eddyrl.config import load_config
from eddyrl.hal import registry
from eddyrl.hal.base import Platform
from eddyrl.resolved import runtime_settings
from eddyrl.runtime import devices


class _Acme(Platform):
    """A vendor's device Ray does not know: it only counts the resource."""

    name = "acme_test"
    device_type = "cpu"
    ray_resource = "ACME"
    visible_devices_env = "ACME_VISIBLE_DEVICES"

    def unavailable_reason(self):
        return None

    def device_count(self):
        return 3


@pytest.fixture
def node_tmp(tmp_path, monkeypatch):
    """This test's own node temporary directory (where the claims live)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("ACME_VISIBLE_DEVICES", raising=False)
    return tmp_path


def test_each_claim_takes_the_lowest_free_device_and_a_closed_one_is_free_again(node_tmp):
    platform = _Acme()
    first, second = (devices.claim_device(platform, f"actor {i}") for i in range(2))
    assert (first[0], second[0]) == (0, 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another actor of the node
        try:
            index, _ = devices.claim_device(platform, "child")
            os.write(write, str(index).encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 8) == b"2"  # another actor of the node: the next free one
    first[1].close()  # the actor of device 0 ended
    again, handle = devices.claim_device(platform, "replacement")
    assert again == 0  # (the child's device 2 went with it: the next claim would get 2)
    assert "pid" in (node_tmp / f"eddy-devices-{os.getuid()}" / "acme_test" / "0.lock"
                     ).read_text()
    handle.close()
    second[1].close()


def test_a_node_whose_devices_are_all_held_says_by_whom(node_tmp):
    platform = _Acme()
    read, write = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # holds all three devices until told to stop
        try:
            held = [devices.claim_device(platform, f"holder {i}") for i in range(3)]
            os.write(write, b"x")
            os.read(go_r, 1)
            for _, handle in held:
                handle.close()
        finally:
            os._exit(0)
    try:
        os.read(read, 1)
        with pytest.raises(RuntimeError) as err:
            devices.claim_device(platform, "late")
        message = str(err.value)
        assert "every acme_test device of this node is held" in message
        assert f"pid {pid} (holder 0)" in message and "3 device(s)" in message
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)


def test_bindings_without_ray_and_on_the_cpu(node_tmp, monkeypatch):
    from eddyrl.hal.cpu import CpuPlatform

    assert devices.bind_actor_device(CpuPlatform(), "t").how == "host"
    monkeypatch.setenv("LOCAL_RANK", "2")
    binding = devices.bind_actor_device(_Acme(), "t")  # no Ray here: as torchrun would
    assert (binding.how, binding.index, binding.local) == ("process", 2, 2)


def test_bind_device_sets_the_visible_devices_variable_or_the_index(monkeypatch):
    monkeypatch.delenv("ACME_VISIBLE_DEVICES", raising=False)
    platform = _Acme()
    assert platform.bind_device(2) == 0 and os.environ["ACME_VISIBLE_DEVICES"] == "2"
    assert platform.local_rank() == 0

    class NoVariable(_Acme):
        visible_devices_env = None

    other = NoVariable()
    assert other.bind_device(2) == 2 and other.local_rank() == 2
    assert other.bind_device(1, narrowed=True) == 0  # Ray made only that one visible


def test_a_colocated_actor_shares_its_partners_device(node_tmp, monkeypatch):
    monkeypatch.setattr(devices, "_ray_assigned_ids", lambda resource: [])  # Ray only counts
    platform = _Acme()
    trainer = devices.bind_actor_device(platform, "trainer rank 0")
    worker = devices.bind_actor_device(_Acme(), "rollout worker 0", shared=trainer.index)
    assert (trainer.how, worker.how, worker.index) == ("claimed", "shared", trainer.index)
    monkeypatch.setattr(devices, "_ray_assigned_ids", lambda resource: ["5"])  # Ray's ids
    ray_bound = devices.bind_actor_device(_Acme(), "trainer rank 1")
    assert (ray_bound.how, ray_bound.index, ray_bound.local) == ("ray", 5, 0)
    trainer.lock.close()


def test_a_local_ray_declares_a_plugins_devices(monkeypatch):
    monkeypatch.setitem(registry.platform_classes(), _Acme.name, _Acme)
    def declared(*overrides: str) -> dict[str, float]:
        return devices.node_resources(runtime_settings(load_config(overrides=[*overrides])
                                                       ).platforms)

    assert declared("platform=cpu") == {}
    assert declared("platform=cuda") == {}  # Ray's own
    assert declared("platform=cpu", "rollout.platform=acme_test") == {"ACME": 3.0}

"""The `tcp://` rendezvous (hal/rendezvous.py): rank 0's store listens on the node's cluster
address only, never on every interface as torch's own server does; and where each platform's
collective libraries put their sockets (`socket_env`)."""

import psutil
import pytest

from eddyrl.hal.base import interface_of, loopback_interface
from eddyrl.hal.rendezvous import TcpStoreServer, make_store


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_rank_0_serves_the_store_on_its_address_only_and_members_join_it():
    server = TcpStoreServer("127.0.0.1", 2, timeout_s=30)
    try:
        assert server.url == f"tcp://127.0.0.1:{server.port}"
        assert _listening(server.port) == {"127.0.0.1"}  # not 0.0.0.0 / ::
        member = make_store(server.url, 1, 2, timeout_s=30)
        member.set("from rank 1", "hello")
        assert server.store.get("from rank 1") == b"hello"
    finally:
        server.close()
    assert not _listening(server.port)


def test_rank_0_of_a_tcp_rendezvous_must_bring_its_own_store():
    with pytest.raises(ValueError, match="rank 0 .* serves the store"):
        make_store("tcp://127.0.0.1:1", 0, 2)
    with pytest.raises(ValueError, match="must be file:///path or tcp://host:port"):
        make_store("http://127.0.0.1:1", 1, 2)


def test_each_platform_puts_its_collective_sockets_on_the_nodes_interface():
    from eddyrl.hal.cpu import CpuPlatform
    from eddyrl.hal.cuda import CudaPlatform
    from eddyrl.hal.npu import NpuPlatform

    assert CpuPlatform().socket_env("eth7", "10.1.2.3") == {"GLOO_SOCKET_IFNAME": "eth7"}
    assert CudaPlatform().socket_env("eth7", "10.1.2.3") == {
        "GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "eth7"}
    assert NpuPlatform().socket_env("eth7", "10.1.2.3") == {
        "GLOO_SOCKET_IFNAME": "eth7", "HCCL_SOCKET_IFNAME": "eth7", "HCCL_IF_IP": "10.1.2.3"}
    lo = loopback_interface()
    assert CpuPlatform().loopback_env() == {"GLOO_SOCKET_IFNAME": lo}


def test_the_interface_of_an_address_is_the_one_that_holds_it():
    assert interface_of("127.0.0.1") == loopback_interface()
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family.name == "AF_INET" and not address.address.startswith("127."):
                assert interface_of(address.address) == name
    # TEST-NET-3 (RFC 5737): documentation only, on no interface of a test machine
    with pytest.raises(RuntimeError, match="no network interface of this machine holds "
                                           "203.0.113.254"):
        interface_of("203.0.113.254")

"""Where the members of a process group find each other: a key-value store, read once while
the group forms (torch.distributed's c10d stores; device-neutral, so one module for every
platform).

- `file:///path`: every member on one machine. No listening socket at all; what a run on a
  local Ray uses (its groups never leave the machine, and a file is what is safest there).
- `tcp://address:port`: members on several machines. The store's server runs in the process of
  the group's rank 0, on that node's cluster address only (`open_tcp_store`): torch's own
  `TCPStore(host, port, is_master=True)` listens on every interface (`*:port`, measured with
  torch 2.13) whatever `host` says, so rank 0 binds the socket itself, to `address` and a port
  the kernel picks (no race for a "free" port), and hands the store its descriptor. The URL then
  travels to the other members as data (through Ray, in Eddy's runtime).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any
from urllib.parse import urlparse


class TcpStoreServer:
    """Rank 0's end of a `tcp://` rendezvous: the store (pass it as `store=` to the group),
    serving on a socket bound here; kept for as long as the group may need it."""

    def __init__(self, address: str, world_size: int, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((address, 0))
            self._socket.listen(max(128, world_size))
            self.port = self._socket.getsockname()[1]
            self.store = dist.TCPStore(address, self.port, world_size, is_master=True,
                                       timeout=datetime.timedelta(seconds=timeout_s),
                                       wait_for_workers=False,
                                       master_listen_fd=self._socket.fileno())
        except BaseException:
            self._socket.close()
            raise
        self._socket.detach()  # the store owns the descriptor now, and closes it with itself
        host = f"[{address}]" if family == socket.AF_INET6 else address
        self.url = f"tcp://{host}:{self.port}"

    def close(self) -> None:
        self.store = None  # its server stops, and closes the listening socket


def make_store(rendezvous: str, rank: int, world_size: int, timeout_s: float = 600.0) -> Any:
    """A member's store for `rendezvous`: `file:///path`, or a client of a `tcp://` one (rank 0
    of a tcp rendezvous passes its `TcpStoreServer.store` instead: a store made here for rank 0
    would be torch's own server, listening on every interface)."""
    import torch.distributed as dist

    url = urlparse(rendezvous)
    if url.scheme == "file":
        return dist.FileStore(url.path, world_size)
    if url.scheme == "tcp" and url.hostname and url.port:
        if rank == 0:
            raise ValueError(f"rank 0 of {rendezvous} serves the store: pass its "
                             "TcpStoreServer.store (hal.rendezvous), not a new one")
        return dist.TCPStore(url.hostname, url.port, world_size, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    raise ValueError(f"rendezvous {rendezvous!r} must be file:///path or tcp://host:port")

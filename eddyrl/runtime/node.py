"""Which node of the cluster this process runs on, as the network sees it."""

from __future__ import annotations


def node_address() -> str | None:
    """This process's node address in the Ray cluster it is part of (the address Ray's own
    servers on the node use: where a rendezvous store or a collective's sockets belong); None
    in a process outside Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return ray.util.get_node_ip_address()

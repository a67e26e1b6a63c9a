"""The private subnet of one two-host fixture (`hosts.TwoHosts`), its own on this machine for as
long as its hosts exist.

Two copies of the test suite may run at once (a developer's run beside CI, two clones). Each
fixture takes a /24 of POOLS, tried from a random start, skipping any that overlaps a route or
address of the machine, and claims it by binding an abstract Unix socket named after it
(CLAIM_PREFIX + "10.213.7.0/24"). The kernel refuses a second bind of that name, so no two
fixtures hold one subnet, and drops the claim when the last process holding the socket ends,
however it ends: nothing is written anywhere, nothing is left to clean up. The fixture's watchdog
inherits the socket, so the claim lasts until the namespaces using the subnet are gone, even
when the test process is killed.

(The hosts' addresses never leave their own network namespaces, so two fixtures on one subnet
would still not reach each other; a subnet of its own keeps every address of a run its own, and
lets a test check that one run's hosts cannot reach the other's.)
"""

from __future__ import annotations

import errno
import ipaddress
import re
import secrets
import socket
import subprocess

# Private ranges cut into /24s: 512 candidates.
POOLS = ("10.213.0.0/16", "172.29.0.0/16")
CLAIM_PREFIX = "eddy-multinode-subnet/"  # abstract socket names (in the test's network namespace)


class SubnetError(RuntimeError):
    pass


def machine_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 route (any table) and address of the machine (the test's network namespace)."""
    taken = []
    for argv in (["ip", "-4", "route", "show", "table", "all"], ["ip", "-4", "-o", "addr"]):
        out = subprocess.run(argv, capture_output=True, text=True).stdout
        for word in out.split():
            if word == "default" or not re.fullmatch(r"[0-9.]+(/[0-9]+)?", word):
                continue
            try:
                taken.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                pass
    return taken


def claim(subnet: ipaddress.IPv4Network) -> socket.socket | None:
    """The socket that holds `subnet` for its holders' lifetime, or None if another holds it."""
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        holder.bind(f"\0{CLAIM_PREFIX}{subnet}")
    except OSError as error:
        holder.close()
        if error.errno == errno.EADDRINUSE:
            return None
        raise
    return holder


def claim_free_subnet() -> tuple[ipaddress.IPv4Network, socket.socket]:
    """A /24 of POOLS that overlaps nothing of the machine's and no other fixture holds, with
    the socket that holds it (close it, and every inherited copy, to give it back)."""
    taken = machine_networks()
    candidates = [subnet for pool in POOLS
                  for subnet in ipaddress.ip_network(pool).subnets(new_prefix=24)]
    start = secrets.randbelow(len(candidates))  # two runs rarely even try the same one first
    for subnet in candidates[start:] + candidates[:start]:
        if any(subnet.overlaps(net) for net in taken):
            continue
        holder = claim(subnet)
        if holder is not None:
            return subnet, holder
    raise SubnetError(f"no /24 of {POOLS} is free here: each overlaps a route or address "
                      f"({taken}) or is held by another two-host fixture")

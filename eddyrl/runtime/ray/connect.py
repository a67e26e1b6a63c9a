"""Joining a Ray cluster (`cluster.address`): fail within seconds, in one line that names the
address and what was tried, instead of Ray's minute of repeated GCS warnings and a traceback.

- `host:port`: a TCP connection first (refused, unreachable, no answer within CONNECT_S, a name
  that does not resolve: each said as such); then a gRPC handshake within GRPC_S (a server
  that accepts but is not Ray's GCS: Ray would wait on it for minutes); then `ray.init`, with
  Ray's GCS connection retries bounded (JOIN_RETRIES, about a second each), and a refusal of
  the driver's token named.
- `auto`: the cluster this machine belongs to (RAY_ADDRESS, else the one `ray start` started
  here), as Ray finds it.
"""

from __future__ import annotations

import os
import socket

from ...errors import ConfigError

CONNECT_S = 5.0  # a TCP connection to the head
GRPC_S = 10.0  # its gRPC handshake (Ray's GCS speaks gRPC; Ray itself would wait minutes)
JOIN_RETRIES = 10  # Ray's GCS connection attempts (its default, 20, takes 20-60 s to fail)


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of a `host:port` address, or a ConfigError naming it."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"cluster.address = {address!r} is not host:port or auto")
    return host.strip("[]"), int(port)


def check_reachable(address: str) -> None:
    """That something accepts TCP connections at `address` (host:port), or a ConfigError that
    says what happened."""
    host, port = split_address(address)
    where = f"cluster.address = {address!r}"
    try:
        socket.create_connection((host, port), timeout=CONNECT_S).close()
    except socket.gaierror as exc:
        raise ConfigError(f"{where}: the host name {host!r} does not resolve "
                          f"({exc.strerror})") from None
    except ConnectionRefusedError:
        raise ConfigError(f"{where}: nothing listens at {host}:{port} (connection refused); "
                          f"is the Ray head running there (ray start --head --port={port})?"
                          ) from None
    except TimeoutError:
        raise ConfigError(f"{where}: no answer from {host}:{port} within {CONNECT_S:.0f} s "
                          "(a wrong host, or a firewall)") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot connect to {host}:{port} "
                          f"({exc.strerror or exc})") from None


def check_grpc(address: str) -> None:
    """That the server at `address` completes a gRPC (HTTP/2) handshake within GRPC_S."""
    import grpc

    host, port = split_address(address)
    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=GRPC_S)
    except grpc.FutureTimeoutError:
        raise ConfigError(f"cluster.address = {address!r}: {host}:{port} accepts connections "
                          f"but did not answer as Ray's GCS (no gRPC handshake within "
                          f"{GRPC_S:.0f} s); is that the head's GCS port (ray start --head "
                          "--port)?") from None
    finally:
        channel.close()


def prepare_join(address: str) -> None:
    """Before `ray.init` joins `address`: what Ray reads from the environment when imported."""
    if address != "auto" and split_address(address)[0] in ("127.0.0.1", "localhost", "::1"):
        # else ray.init replaces a loopback head address with the machine's own (lifecycle.py)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")) and \
            not os.environ.get("RAY_AUTH_MODE"):
        # a driver joining sends a token only in token mode (a `ray start` head enables it
        # when it finds one; a joining process does not)
        os.environ["RAY_AUTH_MODE"] = "token"


def join(address: str) -> None:
    """`ray.init(address)`, failing within about JOIN_RETRIES seconds with one line."""
    import ray
    from ray._private import ray_constants

    if address != "auto":
        check_reachable(address)
        check_grpc(address)
    if "RAY_NUM_REDIS_GET_RETRIES" not in os.environ:
        ray_constants.NUM_REDIS_GET_RETRIES = JOIN_RETRIES
    try:
        ray.init(address=address, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        text = str(exc)
        if "Authentication" in text or "InvalidAuthToken" in text or "UNAUTHENTICATED" in text:
            why = ("it refused this driver's auth token: give the driver the cluster's token "
                   "(RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)")
        elif address == "auto" and "Could not find any running Ray instance" in text:
            why = ("no Ray cluster runs on this machine or in RAY_ADDRESS; start one (ray "
                   "start --head) or give its host:port")
        else:
            why = f"Ray could not join it: {text.strip().splitlines()[-1][:300]}"
        raise ConfigError(f"cluster.address = {address!r}: {why}") from None

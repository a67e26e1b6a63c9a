"""A wrong or dead `cluster.address` (issue 21): `eddy train` ends with one line that names the
address and what was tried, no traceback, before any data is generated (Ray alone printed a
minute of GCS warnings first, and waited minutes on a server that is not Ray). How long it
takes is printed, not asserted (a loaded machine). Only loopback and the test's own sockets
are contacted."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest



def _eddy_train(address: str, tmp_path, wrap=lambda command: command, **env):
    started = time.monotonic()
    done = subprocess.run(
        wrap([sys.executable, "-m", "eddyrl.cli", "train", f"cluster.address={address}",
              "train.num_workers=2", f"run_dir={tmp_path / 'run'}"]),
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "EDDY_PLATFORM": "cpu", "RAY_TMPDIR": str(tmp_path), **env})
    return done, time.monotonic() - started


def _closed_port() -> int:
    with socket.socket() as probe:  # bound, never listening: connections are refused
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _last_line(done) -> str:
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_nothing_listening_at_the_address_is_said_in_one_line(tmp_path):
    port = _closed_port()
    done, took = _eddy_train(f"127.0.0.1:{port}", tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert _last_line(done) == (
        f"eddy: error: cluster.address = '127.0.0.1:{port}': nothing listens at "
        f"127.0.0.1:{port} (connection refused); is the Ray head running there (ray start "
        f"--head --port={port})?")
    print(f"refused: {took:.1f} s")


@pytest.mark.slow
def test_a_server_that_is_not_ray_is_refused_in_one_line_within_30_s(tmp_path):
    """Something accepts connections and answers nothing (a wrong port): Ray waited on it
    for minutes; now a gRPC handshake is given 10 s."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted = []

    def accept():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    port = server.getsockname()[1]
    try:
        done, took = _eddy_train(f"127.0.0.1:{port}", tmp_path)
    finally:
        server.close()
        for connection in accepted:
            connection.close()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert _last_line(done) == (
        f"eddy: error: cluster.address = '127.0.0.1:{port}': 127.0.0.1:{port} accepts "
        "connections but did not answer as Ray's GCS (no gRPC handshake within 10 s); is that "
        "the head's GCS port (ray start --head --port)?"), done.stderr[-3000:]
    print(f"not Ray: {took:.1f} s")


def _alone(command: list[str]) -> list[str]:
    """`command` in a PID namespace of its own (root, util-linux's unshare): Ray's `auto` finds
    a cluster by scanning the machine's processes for a GCS server, and another run's local Ray
    (another copy of the suite, another test worker) is one; inside, it sees only its own."""
    alone = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0 or shutil.which("unshare") is None or subprocess.run(
            [*alone, "true"], capture_output=True).returncode != 0:  # no namespaces here
        return command
    return [*alone, *command]


def test_auto_with_no_cluster_on_the_machine_says_so(tmp_path):
    done, _ = _eddy_train("auto", tmp_path, wrap=_alone, RAY_ADDRESS="")
    assert done.returncode == 2, done.stderr[-3000:]
    assert _last_line(done).startswith("eddy: error: cluster.address = 'auto': no Ray "
                                       "cluster runs on this machine"), done.stderr[-3000:]

"""The trainer's data-parallel group across two hosts, without Ray (issue 21): trainer rank 0 in
host A, rank 1 in host B (tests/multinode/hosts.py), meeting through the `tcp://` store rank 0
serves on A's address, as `TrainerRank.start` does in a cluster. Then, from the same two
processes, the collective weight channel from A's trainer to a receiver on B.

Asserted:
(a) the two-host update is the update one rank takes on the whole batch: the same steps,
    assertions and tolerances as tests/integration/engines/test_fsdp_data_parallel.py (whose constants and
    step loop are imported), weights, loss, grad_norm and the other metrics;
(b) the trained weights, sent by rank 0 on A in buckets through `CollectiveChannel` (gloo),
    arrive on B equal, bucket by bucket;
(c) the gloo sockets went over the veth: GLOO_SOCKET_IFNAME in each rank is its host's veth
    (not loopback, as the test process may set it), every TCP socket the ranks listen on is on
    their host's address (no wildcard, no loopback), every connection they hold is between the
    two hosts' addresses, and rank 1 on B holds connections to A beyond the two stores' (gloo's).
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ENGINES_TESTS = str(Path(__file__).resolve().parents[1] / "support")
if ENGINES_TESTS not in sys.path:  # where tests/conftest.py puts it
    sys.path.insert(0, ENGINES_TESTS)

from fsdp_helpers import make_batch, save_tiny_model  # noqa: E402
from tests.integration.engines.test_fsdp_data_parallel import (ENGINE_ARGS, SPLITS, WORLD, _run,  # noqa: E402
                                     assert_ranks_take_one_ranks_steps)

from eddyrl.engines.training.fsdp import FSDPTrainEngine  # noqa: E402
from eddyrl.hal import get_platform  # noqa: E402

GROUP_TIMEOUT_S = 300.0  # one collective or the rendezvous, inside the ranks (a hang guard)
DEADLINE_S = 900.0  # both ranks, imports included, on a busy 2-core machine (a hang guard)
CHANNEL_BUCKET_BYTES = 1 << 20  # the tiny model's 3.4 MB go in several buckets
# Each host gets its own copy of the model in its own /tmp (as on two machines); both see the
# shared directory, which carries only the rendezvous URLs, the batch and the results.
MODEL_IN_HOST = "/tmp/model"

RANK_SCRIPT = """
import os, sys, time
import torch

rank, work, address, engines_tests, tests_dir = (int(sys.argv[1]), *sys.argv[2:6])
sys.path[:0] = [engines_tests, tests_dir, os.path.dirname(tests_dir)]
from tests.integration.engines.test_fsdp_data_parallel import ENGINE_ARGS, SPLITS, WORLD, _run
from multinode.hosts import _proc_ip

from eddyrl.engines.training.fsdp import FSDPTrainEngine
from eddyrl.hal import CollectiveChannel, get_platform
from eddyrl.hal import distributed as hd
from eddyrl.hal.base import interface_of
from eddyrl.hal.rendezvous import TcpStoreServer, make_store

TIMEOUT = float(os.environ["GROUP_TIMEOUT_S"])
torch.set_num_threads(1)  # two ranks share two cores with everything else
os.environ["LOCAL_RANK"] = "0"  # each rank is alone on its host


def publish(name, value):
    tmp = os.path.join(work, name + ".tmp")
    torch.save(value, tmp)
    os.rename(tmp, os.path.join(work, name))


def wait_for(name):
    path, deadline = os.path.join(work, name), time.monotonic() + TIMEOUT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no {name} after {TIMEOUT} s")
        time.sleep(0.1)
    return torch.load(path, weights_only=False)


def serve_or_join(name):
    # rank 0 serves the store on its host's address and publishes the URL; rank 1 joins it
    if rank == 0:
        server = TcpStoreServer(address, WORLD, TIMEOUT)
        publish(name, server.url)
        return server, server.url, server.store
    url = wait_for(name)
    return None, url, make_store(url, rank, WORLD, TIMEOUT)


def own_tcp_sockets():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    listen, connected = [], []
    for proto in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{proto}") as file:
            for line in file.read().splitlines()[1:]:
                fields = line.split()
                if int(fields[9]) not in inodes:
                    continue
                (lip, lport), (rip, rport) = (f.split(":") for f in fields[1:3])
                local = (_proc_ip(lip), int(lport, 16))
                remote = (_proc_ip(rip), int(rport, 16))
                if fields[3] == "0A":
                    listen.append(local)
                elif fields[3] == "01":
                    connected.append((local, remote))
    return {"listen": listen, "connected": connected}


platform = get_platform("cpu")
trainer_server, url, store = serve_or_join("trainer.url")
# as TrainerRank.start: join the group on the store, on this node's address; the engine finds
# the group joined and leaves it be
platform.init_process_group(rank, WORLD, None, TIMEOUT, store=store, address=address)
batch = torch.load(os.path.join(work, "batch.pt"), weights_only=False)
engine = FSDPTrainEngine(os.environ["MODEL_DIR"], platform, rank, WORLD, url, local=False,
                         timeout_s=TIMEOUT, **ENGINE_ARGS)
history = _run(engine, batch, [split[rank] for split in SPLITS])
buckets = [{k: v.clone() for k, v in b.items()}
           for b in engine.export_weights(int(os.environ["CHANNEL_BUCKET_BYTES"]))]

# the weight channel: rank 0 sends, the process on host B receives
channel_server, channel_url, channel_store = serve_or_join("channel.url")
channel = CollectiveChannel.connect(platform, channel_url, rank, WORLD, TIMEOUT,
                                    store=channel_store, address=address)
if rank == 0:  # the specs go as data (through Ray in Eddy's runtime), here as a file
    publish("channel.specs", [channel.describe(bucket) for bucket in buckets])
    for bucket in buckets:
        channel.send(bucket)
    moved = buckets
else:
    moved = [channel.receive(spec) for spec in wait_for("channel.specs")]
sockets = own_tcp_sockets()  # both groups still up
hd.barrier()
channel.close()
engine.close()
hd.destroy()
torch.save({"history": history, "moved": moved, "sockets": sockets,
            "store_ports": [int(u.rsplit(":", 1)[1]) for u in (url, channel_url)],
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "interface": interface_of(address)}, os.path.join(work, f"out.{rank}"))
for server in (channel_server, trainer_server):
    if server is not None:
        server.close()
"""


def _plain(ip: str) -> str:
    address = ipaddress.ip_address(ip)
    return str(getattr(address, "ipv4_mapped", None) or address)


def _wait(processes, logs, timeout_s: float) -> None:
    """Both ranks to their end; a failed one fails the test with its output, a hang at the
    deadline too (the fixture kills what is left, by PID)."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in processes):
        failed = [(r, p) for r, p in enumerate(processes) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            why = f"rank {failed[0][0]} exited with {failed[0][1].returncode}" if failed else \
                f"the ranks were still running after {timeout_s:.0f} s"
            tails = "\n".join(f"--- rank {r} (tail)\n{log.read_text()[-3000:]}"
                              for r, log in enumerate(logs))
            pytest.fail(f"{why}\n{tails}")
        time.sleep(0.5)
    for rank, (process, log) in enumerate(zip(processes, logs)):
        assert process.returncode == 0, f"rank {rank}:\n{log.read_text()[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S + 300)
def test_two_ranks_across_two_hosts_match_one_rank_and_sync_weights_over_the_veth(
        two_hosts, tmp_path):
    hosts = two_hosts
    model_dir = save_tiny_model(str(tmp_path / "tiny"))
    for host in hosts.hosts:
        shutil.copytree(model_dir, host.path(MODEL_IN_HOST))
    batch = make_batch(model_dir)
    work = hosts.shared_dir
    torch.save(batch, work / "batch.pt")
    script = work / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = {"MODEL_DIR": MODEL_IN_HOST, "GROUP_TIMEOUT_S": str(GROUP_TIMEOUT_S),
           "CHANNEL_BUCKET_BYTES": str(CHANNEL_BUCKET_BYTES), "OMP_NUM_THREADS": "1"}
    processes, logs = [], []
    began = time.monotonic()
    for rank, host in enumerate(hosts.hosts):
        logs.append(tmp_path / f"rank{rank}.log")
        with open(logs[-1], "w") as log:
            processes.append(host.popen(
                [sys.executable, str(script), str(rank), str(work), host.address,
                 ENGINES_TESTS, tests_dir], env=env, stdout=log, stderr=subprocess.STDOUT))

    single = FSDPTrainEngine(model_dir, get_platform("cpu"), 0, 1, f"file://{tmp_path}/init1",
                             **ENGINE_ARGS)
    try:  # the one-rank reference, in the test process, while the ranks start
        expected = _run(single, batch, [slice(0, 4)] * len(SPLITS))
    finally:
        single.close()
    _wait(processes, logs, DEADLINE_S)
    ranks_s = time.monotonic() - began
    results = [torch.load(work / f"out.{rank}", weights_only=False) for rank in range(WORLD)]

    # (a) the same update as one rank on the whole batch
    ranks = [r["history"] for r in results]
    assert_ranks_take_one_ranks_steps(expected, ranks)

    # (b) the weight channel: B received, bucket by bucket, what A sent
    sent, received = results[0]["moved"], results[1]["moved"]
    assert len(sent) >= 2, f"the weights went in {len(sent)} bucket(s)"
    assert [list(b) for b in received] == [list(b) for b in sent]
    for bucket_sent, bucket_received in zip(sent, received):
        for name, tensor in bucket_sent.items():
            assert bucket_received[name].dtype == tensor.dtype, name
            assert torch.equal(bucket_received[name], tensor), f"{name} changed on the way"
    final = ranks[0][-1][1]  # what was sent is the trained model
    assert {k for b in sent for k in b} == final.keys()
    assert all(torch.equal(b[k], final[k]) for b in sent for k in b)

    # (c) over the veth
    addresses = {host.address for host in hosts.hosts}
    for rank, (host, result) in enumerate(zip(hosts.hosts, results)):
        assert result["ifname"] == result["interface"] == "veth0", (rank, result["ifname"])
        listen = [(_plain(ip), port) for ip, port in result["sockets"]["listen"]]
        assert listen, f"rank {rank} listens on nothing"
        assert all(ip == host.address for ip, _ in listen), (rank, listen)
        connected = [((_plain(a), p), (_plain(b), q))
                     for (a, p), (b, q) in result["sockets"]["connected"]]
        assert connected, f"rank {rank} holds no connection"
        for local, remote in connected:
            assert local[0] == host.address and remote[0] in addresses, (rank, local, remote)
    # rank 1's connections to A: the two stores' ports (the rendezvous), and others: gloo's
    # (B connected to a listener of A, or A to one of B: then A's end is not a store port)
    store_ports = set(results[0]["store_ports"])
    to_a = [(local, remote) for local, remote in results[1]["sockets"]["connected"]
            if _plain(remote[0]) == hosts.a.address]
    assert {remote[1] for _, remote in to_a} > store_ports, to_a
    print(f"two ranks across two hosts: {ranks_s:.1f} s from start to both results "
          f"(imports included); rank 1's connections to A: {to_a}")

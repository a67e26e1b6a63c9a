"""A real 2-process group through the HAL: collectives, and the collective weight channel.

Each check spawns two ranks with `torch.multiprocessing` (spawn: a fresh interpreter, no device
context inherited), which find the platform by name through `get_platform` (a plug-in's entry
point is visible to them as to the parent), meet through a file rendezvous in a temporary
folder and keep every socket on loopback. The ranks save what they saw; the parent compares.
A rank that hangs is killed by PID at a deadline, so a broken collective is a failure, not a
stuck command.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time

import torch
import torch.multiprocessing as mp

from ..hal import CollectiveChannel, Platform, get_platform, iter_buckets
from ..hal import distributed as hd
from .common import CheckSkipped

WORLD = 2
GROUP_TIMEOUT_S = 120.0  # one collective, inside the group
# The whole spawn: two fresh interpreters import torch (tens of seconds on a busy small host)
# before the group forms. Against a hang only; never a speed check.
DEADLINE_S = 600.0


def _needs_two_devices(platform: Platform) -> None:
    # Device backends refuse two ranks of one group on one device; the CPU has no such limit.
    count = platform.device_count()
    if platform.device_type != "cpu" and count < WORLD:
        raise CheckSkipped(f"{platform.name}: needs {WORLD} devices, has {count}")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _spawn(worker, *args) -> None:
    """Run `worker(rank, *args)` in WORLD spawned processes until all exit, or raise."""
    context = mp.start_processes(worker, args=args, nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {WORLD} ranks were still running after "
                                   f"{DEADLINE_S:.0f} s: a collective or the rendezvous hangs")
    except mp.ProcessRaisedException as exc:  # the rank's traceback ends with its error
        raise RuntimeError(f"rank {exc.error_index} failed: {_last_line(exc.msg)}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"rank {exc.error_index} died (exit code {exc.exit_code}, signal "
                           f"{exc.signal_name})") from None
    finally:
        for process in context.processes:  # by PID: only the ranks this check started
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join(30)


def _join(rank: int, name: str, init_file: str) -> Platform:
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)  # two ranks share the host with the parent
    platform = get_platform(name)
    platform.init_process_group(rank, WORLD, f"file://{init_file}",
                                timeout_s=GROUP_TIMEOUT_S, local=True)
    return platform


def _collectives_worker(rank: int, name: str, work: str) -> None:
    platform = _join(rank, name, f"{work}/init")
    device = platform.device(rank)
    try:
        b = hd.broadcast(torch.full((3,), float(rank + 7), device=device), src=1)
        s = hd.all_reduce(torch.tensor([rank + 1.0, 10.0], device=device), op="sum")
        a = hd.all_reduce(torch.tensor([rank * 2.0], device=device), op="avg")
        m = hd.all_reduce(torch.tensor([float(rank)], device=device), op="max")
        g = hd.all_gather(torch.tensor([rank, rank * 10], device=device))
        o = hd.all_gather_object({"rank": rank})
        cpu_side = hd.all_reduce(torch.tensor([1.0]), op="sum")  # metadata over gloo
        hd.barrier()
        result = {"b": b.cpu(), "s": s.cpu(), "a": a.cpu(), "m": m.cpu(),
                  "g": [t.cpu() for t in g], "o": o, "cpu": cpu_side, "world": hd.world_size(),
                  "device": b.device.type}
        torch.save(result, f"{work}/out.{rank}")
    finally:
        hd.destroy()


def _expect_equal(rank: int, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want), f"rank {rank}: {what} gave {got.tolist()}, expected " \
        f"{want.tolist()}"


def check_collectives(platform: Platform) -> str:
    """broadcast, all_reduce (sum, avg, max), all_gather, all_gather_object, a CPU-side
    metadata reduce and a barrier between 2 processes."""
    _needs_two_devices(platform)
    with tempfile.TemporaryDirectory(prefix="eddy_check_") as work:
        _spawn(_collectives_worker, platform.name, work)
        results = [torch.load(f"{work}/out.{rank}", weights_only=True) for rank in range(WORLD)]
    for rank, r in enumerate(results):
        assert r["world"] == WORLD, f"rank {rank}: world_size() = {r['world']}, not {WORLD}"
        assert r["device"] == platform.device_type, \
            f"rank {rank}: the broadcast tensor was on a {r['device']!r} device"
        _expect_equal(rank, "broadcast from rank 1", r["b"], torch.full((3,), 8.0))
        _expect_equal(rank, "all_reduce sum", r["s"], torch.tensor([3.0, 20.0]))
        _expect_equal(rank, "all_reduce avg", r["a"], torch.tensor([1.0]))
        _expect_equal(rank, "all_reduce max", r["m"], torch.tensor([1.0]))
        gathered = [t.tolist() for t in r["g"]]
        assert gathered == [[0, 0], [1, 10]], \
            f"rank {rank}: all_gather gave {gathered}, expected [[0, 0], [1, 10]]"
        assert r["o"] == [{"rank": 0}, {"rank": 1}], \
            f"rank {rank}: all_gather_object gave {r['o']}"
        _expect_equal(rank, "all_reduce of a CPU tensor (metadata)", r["cpu"],
                      torch.tensor([2.0]))
    return f"{WORLD} ranks on {platform.device_type} ({platform.composite_backend()})"


def _channel_worker(rank: int, name: str, work: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    platform = get_platform(name)
    channel = CollectiveChannel.connect(platform, f"file://{work}/store", rank, WORLD,
                                        GROUP_TIMEOUT_S)
    torch.manual_seed(5)  # both ranks know the expected weights; only rank 0 sends them
    weights = {f"w{i}": torch.randn(16, 8 + i) for i in range(4)}
    weights["step"] = torch.tensor([3], dtype=torch.int64)
    buckets = list(iter_buckets(weights.items(), bucket_bytes=2 * 16 * 10 * 4))
    received = {}
    for bucket in buckets:
        spec = channel.describe(bucket)  # the runtime would ship this spec to the receivers
        if rank == 0:
            channel.send(bucket)
        else:
            received.update({k: v.cpu() for k, v in channel.receive(spec).items()})
    channel.close()
    if rank == 1:
        torch.save({"received": received, "expected": weights, "buckets": len(buckets)},
                   f"{work}/out.pt")


def check_collective_weight_channel(platform: Platform) -> str:
    """Weights broadcast in buckets from rank 0 to rank 1 over a standalone group arrive
    unchanged."""
    _needs_two_devices(platform)
    with tempfile.TemporaryDirectory(prefix="eddy_check_") as work:
        _spawn(_channel_worker, platform.name, work)
        r = torch.load(f"{work}/out.pt", weights_only=True)
    assert r["buckets"] >= 2, f"the weights went in {r['buckets']} bucket(s), expected >= 2"
    assert r["received"].keys() == r["expected"].keys(), \
        f"rank 1 received {sorted(r['received'])}, rank 0 sent {sorted(r['expected'])}"
    for name, tensor in r["expected"].items():
        assert torch.equal(r["received"][name], tensor), f"{name} changed on the way"
    return f"{len(r['expected'])} tensors in {r['buckets']} buckets"

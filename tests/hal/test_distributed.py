"""A real 2-process group through the HAL: collectives and the collective weight channel."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from eddyrl.hal import CollectiveChannel, get_platform, iter_buckets
from eddyrl.hal import distributed as hd

WORLD = 2


def _needs_two_devices(platform):
    if platform.device_type != "cpu" and platform.device_count() < WORLD:
        pytest.skip(f"{platform.name}: needs {WORLD} devices, has {platform.device_count()}")


def _collectives_worker(rank: int, name: str, init_file: str, result_file: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    platform = get_platform(name)
    platform.init_process_group(rank, WORLD, f"file://{init_file}", timeout_s=60, local=True)
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
        torch.save(result, f"{result_file}.{rank}")
    finally:
        hd.destroy()


def test_two_process_collectives(platform, tmp_path):
    _needs_two_devices(platform)
    mp.spawn(_collectives_worker, args=(platform.name, str(tmp_path / "init"),
                                        str(tmp_path / "out")), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"out.{rank}")
        assert r["world"] == WORLD and r["device"] == platform.device_type
        assert torch.equal(r["b"], torch.full((3,), 8.0))
        assert torch.equal(r["s"], torch.tensor([3.0, 20.0]))
        assert torch.equal(r["a"], torch.tensor([1.0]))
        assert torch.equal(r["m"], torch.tensor([1.0]))
        assert [t.tolist() for t in r["g"]] == [[0, 0], [1, 10]]
        assert r["o"] == [{"rank": 0}, {"rank": 1}]
        assert torch.equal(r["cpu"], torch.tensor([2.0]))


def _channel_worker(rank: int, name: str, store_file: str, result_file: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    platform = get_platform(name)
    channel = CollectiveChannel.connect(platform, f"file://{store_file}", rank, WORLD, 60)
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
                   result_file)


def test_collective_weight_channel_round_trip(platform, tmp_path):
    _needs_two_devices(platform)
    out = tmp_path / "out.pt"
    mp.spawn(_channel_worker, args=(platform.name, str(tmp_path / "store"), str(out)),
             nprocs=WORLD, join=True)
    r = torch.load(out)
    assert r["buckets"] >= 2
    assert r["received"].keys() == r["expected"].keys()
    for name, tensor in r["expected"].items():
        assert torch.equal(r["received"][name], tensor), name

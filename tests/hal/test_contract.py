"""What every platform must do, checked on each platform present on this machine."""

import pytest
import torch

from eddyrl.hal import HostChannel, iter_buckets


def test_identity(platform):
    info = platform.describe()
    assert info["available"] and info["reason"] is None
    assert info["device_count"] >= 1
    assert info["backend"] == platform.dist_backend()
    assert platform.device(0).type == platform.device_type
    assert platform.properties(0).total_memory > 0


def test_tensors_live_on_the_platform_device(platform):
    device = platform.device(platform.local_rank())
    x = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3)
    y = (x @ x.T).sum()
    platform.synchronize()
    assert x.device.type == platform.device_type
    assert y.item() == pytest.approx(0 + 1 + 4 + 9 + 16 + 25 + 2 * (0 * 3 + 1 * 4 + 2 * 5))


def test_streams_and_events(platform):
    stream = platform.new_stream()
    assert stream is not None
    assert platform.current_stream() is not None
    event = platform.new_event()
    torch.ones(4, device=platform.device(platform.local_rank())).sum()
    event.record()
    event.synchronize()
    assert event.query()


def test_memory_queries_track_allocation(platform):
    before = platform.memory_info()
    assert 0 < before.free <= before.total
    block = torch.ones(32 * 2**20 // 4, device=platform.device(platform.local_rank()))  # 32 MiB
    platform.synchronize()
    during = platform.memory_info()
    assert during.allocated >= before.allocated + 16 * 2**20
    assert during.peak_allocated >= during.allocated
    del block
    platform.empty_cache()
    platform.release_memory()
    platform.restore_memory()


def test_seeded_rng_is_reproducible(platform):
    device = platform.device(platform.local_rank())
    platform.manual_seed(1234)
    a = torch.randn(8, device=device)
    platform.manual_seed(1234)
    b = torch.randn(8, device=device)
    assert torch.equal(a, b)
    state = platform.get_rng_state()
    c = torch.randn(8, device=device)
    platform.set_rng_state(state)
    d = torch.randn(8, device=device)
    assert torch.equal(c, d) and not torch.equal(a, c)


def test_autocast_precision(platform):
    assert platform.supports_dtype(torch.float32)
    device = platform.device(platform.local_rank())
    a = torch.randn(4, 4, device=device)
    with platform.autocast(torch.float32):
        assert (a @ a).dtype == torch.float32
    if platform.supports_dtype(torch.bfloat16):
        with platform.autocast(torch.bfloat16):
            assert (a @ a).dtype == torch.bfloat16
    assert not platform.supports_dtype(torch.float64)


def test_profile_range_and_model_patches_keep_results(platform):
    device = platform.device(platform.local_rank())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to(device)
    x = torch.randn(2, 8, device=device)
    expected = model(x)
    with platform.profile_range("contract-test"):
        patched = platform.apply_model_patches(model)
    torch.testing.assert_close(patched(x), expected)


def test_host_weight_channel_round_trip(platform):
    device = platform.device(platform.local_rank())
    weights = {f"layer{i}.weight": torch.randn(64, 32, device=device) for i in range(5)}
    channel = HostChannel(receiver=platform)
    received = {}
    buckets = list(iter_buckets(weights.items(), bucket_bytes=3 * 64 * 32 * 4))
    assert [len(b) for b in buckets] == [3, 2]
    for bucket in buckets:
        spec = channel.describe(bucket)
        assert all(t.device.type == "cpu" for t in spec.tensors.values())
        channel.send(bucket)
        received.update(channel.receive(spec))
    assert received.keys() == weights.keys()
    for name, tensor in weights.items():
        assert received[name].device.type == platform.device_type
        assert torch.equal(received[name], tensor)


def test_ray_resources_match_the_platform(platform):
    request = platform.ray_actor_resources(0.5)
    if platform.ray_resource is None:
        assert request == {}
    else:
        assert 0.5 in [*request.values(), *request.get("resources", {}).values()]

"""What every platform must do, one plain function per part of the `Platform` contract.

Each `check_*(platform)` returns an optional one-line detail (what it saw) and raises on a
failure, with a message that names what was wrong. The same functions run under pytest
(tests/fast/hal/test_contract.py) and from the installed package (`eddy platforms check NAME`), where
no assertion rewriting explains a bare `assert`: so every assertion carries its own message.
"""

from __future__ import annotations

import math

import torch

from ..hal import HostChannel, Platform, iter_buckets
from .common import MiB, device_of

BLOCK_BYTES = 32 * MiB  # the allocation the memory checks make and look for


def check_identity(platform: Platform) -> str:
    """describe(), device count, properties and device type agree with each other."""
    info = platform.describe()
    assert info["available"] and info["reason"] is None, \
        f"describe() says the platform is unavailable: {info['reason']!r}"
    assert platform.device_count() >= 1, f"device_count() = {platform.device_count()}, not >= 1"
    assert info["device_count"] >= 1, \
        f"describe()['device_count'] = {info['device_count']}, not >= 1"
    assert info["backend"] == platform.dist_backend(), \
        f"describe()['backend'] = {info['backend']!r} but dist_backend() = " \
        f"{platform.dist_backend()!r}"
    device = platform.device(0)
    assert device.type == platform.device_type, \
        f"device(0) is a {device.type!r} device, but device_type = {platform.device_type!r}"
    total = platform.properties(0).total_memory
    assert total > 0, f"properties(0).total_memory = {total}, not > 0"
    return (f"{info['device_count']} x {info['device_name']}, {total / 2**30:.1f} GiB, "
            f"backend {info['backend']}")


def check_tensors(platform: Platform) -> str:
    """Tensors are made and computed on the platform's device."""
    device = device_of(platform)
    x = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3)
    y = (x @ x.T).sum()
    platform.synchronize()
    assert x.device.type == platform.device_type, \
        f"a tensor made on {device} is on a {x.device.type!r} device"
    expected = 0 + 1 + 4 + 9 + 16 + 25 + 2 * (0 * 3 + 1 * 4 + 2 * 5)
    assert math.isclose(y.item(), expected, rel_tol=1e-6), \
        f"(x @ x.T).sum() = {y.item()} on {device}, expected {expected}"
    return f"on {x.device}"


def check_streams_events(platform: Platform) -> None:
    """new_stream, current_stream and an event recorded after some work."""
    stream = platform.new_stream()
    assert stream is not None, "new_stream() returned None"
    assert platform.current_stream() is not None, "current_stream() returned None"
    event = platform.new_event()
    torch.ones(4, device=device_of(platform)).sum()
    event.record()
    event.synchronize()
    assert event.query(), "an event is not complete after event.synchronize()"


def check_memory(platform: Platform) -> str:
    """memory_info() sees a 32 MiB allocation; the cache and sleep hooks can be called."""
    before = platform.memory_info()
    assert 0 < before.free <= before.total, \
        f"memory_info(): free = {before.free} is not in (0, total = {before.total}]"
    planned = platform.device_memory_bytes(0)  # what `eddy plan` compares against
    assert 0 < planned <= platform.properties(0).total_memory, \
        f"device_memory_bytes(0) = {planned} is not in (0, properties(0).total_memory]"
    block = torch.ones(BLOCK_BYTES // 4, device=device_of(platform))
    platform.synchronize()
    during = platform.memory_info()
    grown = during.allocated - before.allocated
    assert grown >= BLOCK_BYTES // 2, \
        f"memory_info().allocated grew by {grown} bytes for a {BLOCK_BYTES}-byte tensor " \
        f"(expected at least {BLOCK_BYTES // 2})"
    assert during.peak_allocated >= during.allocated, \
        f"memory_info(): peak_allocated = {during.peak_allocated} < allocated = " \
        f"{during.allocated}"
    del block
    platform.empty_cache()
    platform.release_memory()
    platform.restore_memory()
    return f"allocated +{grown / MiB:.0f} MiB for a {BLOCK_BYTES // MiB} MiB tensor"


def check_rng(platform: Platform) -> None:
    """manual_seed makes draws reproducible; get/set_rng_state replays them."""
    device = device_of(platform)
    platform.manual_seed(1234)
    a = torch.randn(8, device=device)
    platform.manual_seed(1234)
    b = torch.randn(8, device=device)
    assert torch.equal(a, b), "two draws after manual_seed(1234) differ"
    state = platform.get_rng_state()
    c = torch.randn(8, device=device)
    platform.set_rng_state(state)
    d = torch.randn(8, device=device)
    assert torch.equal(c, d), "a draw after set_rng_state(get_rng_state()) is not replayed"
    assert not torch.equal(a, c), "the generator did not advance: the same draw came twice"


def check_autocast(platform: Platform) -> str:
    """float32 always; bfloat16 where supports_dtype says so; never float64."""
    assert platform.supports_dtype(torch.float32), "supports_dtype(torch.float32) is False"
    device = device_of(platform)
    a = torch.randn(4, 4, device=device)
    with platform.autocast(torch.float32):
        out = (a @ a).dtype
        assert out == torch.float32, f"a matmul under autocast(float32) gave {out}"
    bf16 = platform.supports_dtype(torch.bfloat16)
    if bf16:
        with platform.autocast(torch.bfloat16):
            out = (a @ a).dtype
            assert out == torch.bfloat16, \
                f"supports_dtype(bfloat16) is True but a matmul under autocast gave {out}"
    assert not platform.supports_dtype(torch.float64), \
        "supports_dtype(torch.float64) is True: autocast has no float64 mode"
    return f"bfloat16 {'supported' if bf16 else 'not supported'}"


def check_profile_patches(platform: Platform) -> None:
    """Profile ranges (nested too) and apply_model_patches leave results unchanged."""
    device = device_of(platform)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to(device)
    x = torch.randn(2, 8, device=device)
    expected = model(x)
    with platform.profile_range("contract-test"):
        patched = platform.apply_model_patches(model)
    assert patched is not None, "apply_model_patches returned None, not the model"
    torch.testing.assert_close(patched(x), expected,
                               msg=lambda m: f"apply_model_patches changed the output: {m}")
    with platform.profile_range("contract-outer"):  # engines open ranges inside ranges
        with platform.profile_range("contract-inner"):
            inner = patched(x)
    torch.testing.assert_close(inner, expected,
                               msg=lambda m: f"nested profile ranges changed the output: {m}")


def check_host_weight_channel(platform: Platform) -> str:
    """Weights in buckets through host memory land on the device unchanged."""
    device = device_of(platform)
    weights = {f"layer{i}.weight": torch.randn(64, 32, device=device) for i in range(5)}
    channel = HostChannel(receiver=platform)
    received = {}
    buckets = list(iter_buckets(weights.items(), bucket_bytes=3 * 64 * 32 * 4))
    sizes = [len(b) for b in buckets]
    assert sizes == [3, 2], f"iter_buckets made buckets of {sizes} tensors, expected [3, 2]"
    for bucket in buckets:
        spec = channel.describe(bucket)
        on = {t.device.type for t in spec.tensors.values()}
        assert on == {"cpu"}, f"the host channel's bucket spec holds tensors on {on}"
        channel.send(bucket)
        received.update(channel.receive(spec))
    assert received.keys() == weights.keys(), \
        f"received {sorted(received)}, sent {sorted(weights)}"
    for name, tensor in weights.items():
        assert received[name].device.type == platform.device_type, \
            f"{name} arrived on a {received[name].device.type!r} device"
        assert torch.equal(received[name], tensor), f"{name} changed on the way"
    return f"{len(weights)} tensors in {len(buckets)} buckets"


def check_ray_resources(platform: Platform) -> str:
    """The Ray request for a fraction of a device (and a bundle) names the platform's
    resource."""
    request = platform.ray_actor_resources(0.5)
    bundle = platform.ray_bundle(2)
    if platform.ray_resource is None:
        assert request == {}, f"ray_resource is None but ray_actor_resources(0.5) = {request}"
        assert bundle == {}, f"ray_resource is None but ray_bundle(2) = {bundle}"
        return "CPU only (no Ray resource)"
    asked = [*request.values(), *request.get("resources", {}).values()]
    assert 0.5 in asked, f"ray_actor_resources(0.5) = {request} does not ask for 0.5 of a device"
    assert bundle.get(platform.ray_resource) == 2.0, \
        f"ray_bundle(2) = {bundle}, expected {{{platform.ray_resource!r}: 2.0}}"
    return f"{request}"


def check_sleep_wake(platform: Platform) -> str:
    """release_memory / restore_memory (an engine's sleep and wake), with the tags the engines
    pass: memory comes back after a block is released, and the device works after the wake."""
    device = device_of(platform)
    block = torch.ones(BLOCK_BYTES // 4, device=device)
    platform.synchronize()
    held = platform.memory_info().allocated
    del block
    platform.release_memory()  # an inference engine's sleep
    released = platform.memory_info().allocated
    platform.restore_memory()
    platform.release_memory(("weights",))  # a trainer's offload
    platform.restore_memory(("weights",))
    again = torch.full((BLOCK_BYTES // 4,), 2.0, device=device)
    total = again.sum().item()
    platform.synchronize()
    assert total == 2.0 * again.numel(), \
        f"after restore_memory a new {BLOCK_BYTES // MiB} MiB tensor sums to {total}"
    if platform.device_type == "cpu":
        # Host memory is the process's RSS, which the C allocator returns to the OS when it
        # likes: nothing to hold the hooks to.
        return "host memory: not measured"
    assert released <= held - BLOCK_BYTES // 2, \
        f"memory_info().allocated is {released} bytes after the {BLOCK_BYTES}-byte tensor was " \
        f"freed and release_memory() ran, {held} while it was held: the memory did not come back"
    return f"{(held - released) / MiB:.0f} MiB came back"

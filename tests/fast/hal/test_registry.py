"""Choosing a platform: by name, by EDDY_PLATFORM, by detection; per role; errors."""

import pytest

from eddyrl.config import load_config
from eddyrl.errors import PlatformError
from eddyrl.hal import choose_weight_channel, detect, get_platform, known_platforms
from eddyrl.hal.cpu import CpuPlatform
from eddyrl.hal.cuda import CudaPlatform
from eddyrl.hal.npu import NpuPlatform
from eddyrl.runtime.placement import resolve_role_platforms


def test_builtins_are_known():
    assert {"cpu", "cuda", "npu"} <= set(known_platforms())


def test_unknown_platform_lists_the_known_ones():
    with pytest.raises(PlatformError) as err:
        get_platform("tpu")
    message = str(err.value)
    assert "'tpu'" in message and all(name in message for name in ("cpu", "cuda", "npu"))


@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_absent_accelerator_is_one_clear_sentence(name):
    platform = get_platform(name, require_available=False)
    if platform.is_available():
        pytest.skip(f"{name} is present here")
    with pytest.raises(PlatformError) as err:
        get_platform(name)
    message = str(err.value)
    assert message.startswith(f"platform '{name}' was requested but is not usable here: ")
    assert "\n" not in message and "Traceback" not in message


def test_env_var_then_detection(monkeypatch):
    monkeypatch.setenv("EDDY_PLATFORM", "cpu")
    assert get_platform().name == "cpu"
    assert get_platform("auto").name == "cpu"
    monkeypatch.delenv("EDDY_PLATFORM")
    detected = detect()
    assert detected.is_available()
    accelerators = [get_platform(n, require_available=False) for n in ("cuda", "npu")]
    if not any(p.is_available() for p in accelerators):
        assert detected.name == "cpu"
    else:
        assert detected.name != "cpu"  # an accelerator is preferred over the CPU


def test_explicit_name_beats_env(monkeypatch):
    monkeypatch.setenv("EDDY_PLATFORM", "npu")
    assert get_platform("cpu").name == "cpu"


def test_role_platforms_default_to_the_top_level_platform():
    config = load_config(overrides=["platform=cpu"])
    roles = resolve_role_platforms(config)
    assert roles.rollout.name == roles.train.name == "cpu"
    assert roles.weight_channel == "object_store"


def test_role_platforms_can_differ_and_are_checked():
    config = load_config(overrides=["platform=cpu", "rollout.platform=npu", "train.platform=cuda"])
    roles = resolve_role_platforms(config, require_available=False)
    assert (roles.rollout.name, roles.train.name) == ("npu", "cuda")
    assert roles.weight_channel == "host"  # NVIDIA trainer -> Ascend rollout via host memory
    if not roles.rollout.is_available():
        with pytest.raises(PlatformError, match="'npu' was requested"):
            resolve_role_platforms(config)


@pytest.mark.parametrize("sender, receiver, kind", [
    (CpuPlatform, CpuPlatform, "object_store"),
    (CudaPlatform, CudaPlatform, "collective"),
    (NpuPlatform, NpuPlatform, "collective"),
    (CudaPlatform, NpuPlatform, "host"),
    (NpuPlatform, CpuPlatform, "host"),
    (CpuPlatform, CudaPlatform, "host"),
])
def test_weight_channel_choice(sender, receiver, kind):
    assert choose_weight_channel(sender(), receiver()) == kind


class _HostOnlyCuda(CudaPlatform):
    """A receiver whose devices cannot join the sender's device collective."""

    def weight_channels(self, peer):
        return ("host",)


def test_the_receiver_has_a_say_in_the_weight_channel():
    # the sender would broadcast device to device; the receiver supports only host staging
    assert choose_weight_channel(CudaPlatform(), _HostOnlyCuda()) == "host"
    assert choose_weight_channel(_HostOnlyCuda(), CudaPlatform()) == "host"


def test_the_run_resolves_its_weight_channel_once():
    from eddyrl.runtime.placement import weight_channel_kind

    assert weight_channel_kind(load_config(overrides=["platform=cpu"])) == "object_store"
    assert weight_channel_kind(load_config(overrides=["platform=cpu",
                                                      "train.weight_channel=host"])) == "host"
    # like accelerators colocated: one device per communicator, so host memory instead
    gpu = ["platform=cuda", "rollout.num_workers=1", "train.num_workers=1"]
    assert weight_channel_kind(load_config(overrides=gpu)) == "collective"
    assert weight_channel_kind(load_config(overrides=[*gpu, "cluster.placement=colocated"])) \
        == "host"


def test_composite_backends():
    assert CpuPlatform().composite_backend() == "cpu:gloo"
    assert CudaPlatform().composite_backend() == "cpu:gloo,cuda:nccl"
    assert NpuPlatform().composite_backend() == "cpu:gloo,npu:hccl"
    assert CudaPlatform().visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert NpuPlatform().visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert (CpuPlatform.ray_resource, CudaPlatform.ray_resource, NpuPlatform.ray_resource) == \
        (None, "GPU", "NPU")


class _FlakyVendor(CpuPlatform):
    name = "flakyvendor"
    calls = 0

    def unavailable_reason(self):
        type(self).calls += 1
        raise OSError("libvendor.so missing")


def test_a_hook_that_raises_makes_the_platform_unusable_once_with_one_warning():
    platform = _FlakyVendor()
    with pytest.warns(RuntimeWarning, match="'flakyvendor' is unusable: .*unavailable_reason "
                                            "raised OSError: libvendor.so missing"):
        reason = platform.check_usable()
    assert reason.endswith("unavailable_reason raised OSError: libvendor.so missing")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and no second call
        assert platform.check_usable() == reason and platform.describe()["reason"] == reason
    assert _FlakyVendor.calls == 1


def test_is_available_false_without_a_reason_still_says_why():
    class Quiet(CpuPlatform):
        name = "quiet"

        def is_available(self):
            return False

    assert Quiet().check_usable() == "Quiet.is_available() returned False"

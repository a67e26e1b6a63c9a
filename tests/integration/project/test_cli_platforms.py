"""`eddy platforms` as a user runs it: the installed console script, in a fresh process."""

import shutil
import subprocess
import sys

from eddyrl.hal import get_platform


def test_eddy_platforms_lists_every_platform_with_reasons():
    exe = shutil.which("eddy")
    cmd = [exe, "platforms"] if exe else [sys.executable, "-m", "eddyrl.cli", "platforms"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("cpu", "cuda", "npu"):
        platform = get_platform(name, require_available=False)
        assert f"{name}: " in out.stdout
        if platform.is_available():
            assert f"{name}: unavailable" not in out.stdout
        else:
            assert f"{name}: unavailable: {platform.unavailable_reason()}" in out.stdout
    assert "gloo" in out.stdout and "CUDA_VISIBLE_DEVICES" in out.stdout


def test_requested_absent_platform_is_a_clear_cli_error():
    out = subprocess.run([sys.executable, "-m", "eddyrl.cli", "config", "show", "platform=tpu"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("eddy: error: config key 'platform' = 'tpu' is not allowed")


def test_train_on_an_absent_accelerator_is_one_sentence():
    cuda = get_platform("cuda", require_available=False)
    if cuda.is_available():
        import pytest

        pytest.skip("cuda is present here")
    out = subprocess.run([sys.executable, "-m", "eddyrl.cli", "train", "platform=cuda"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == ("eddy: error: platform 'cuda' was requested but is not usable "
                                  f"here: {cuda.unavailable_reason()}")

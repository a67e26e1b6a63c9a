"""The wheel carries what the installed commands need: build it, install it into a fresh venv
outside the checkout, and run `eddy sim <scenario>`, `eddy config show` and `eddy platforms
check` there.

Offline: the wheel is built with the setuptools already installed (`--no-build-isolation`); the
venv is made `--without-pip`, and this venv's pip (`pip --python NEW_VENV_PYTHON`) installs
only the eddyrl wheel into it (`--no-deps --no-index`). eddyrl's dependencies (torch,
omegaconf, ...) come from the venv that runs the tests, through a .pth file added after the
install, which puts that venv's site-packages after the new venv's own (its .pth files, the
editable install's among them, are not processed). The test asserts that the eddyrl it runs is
the wheel's copy.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 300  # per command, against a hang, not a speed check: the test takes 15-30 s


def _run(argv, cwd, env):
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, (argv, result.stdout[-4000:], result.stderr[-4000:])
    return result.stdout


def _source_copy(dest: Path) -> Path:
    """The files the wheel is built from (pyproject.toml, README.md, eddyrl/), copied so that
    the build writes its build/ and egg-info there, not into the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "eddyrl", dest / "eddyrl",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dest


@pytest.fixture
def scratch():
    """A folder outside the checkout, removed afterwards (venv, wheel and build: ~30 MB)."""
    with tempfile.TemporaryDirectory(prefix="eddy_wheel_") as folder:
        path = Path(folder).resolve()
        assert not path.is_relative_to(ROOT), path
        yield path


def test_the_wheel_installs_and_runs_outside_the_checkout(scratch):
    tmp_path = scratch
    outside = tmp_path / "elsewhere"  # the cwd of every command: no eddyrl/ or configs/ in it
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"

    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", dist, _source_copy(tmp_path / "src")], outside, env)
    (wheel,) = dist.glob("eddyrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("eddyrl/configs/sim/dora_64.yaml", "eddyrl/configs/tiny_cpu.yaml",
                    "eddyrl/configs/tool_add_tiny.yaml", "eddyrl/configs/modes/replay.yaml",
                    "eddyrl/configs/recipes/README.md",
                    "eddyrl/configs/recipes/qwen3_4b_dapo_math_gpu.yaml",
                    "eddyrl/assets/tiny_warmstart/config.json",
                    "eddyrl/configs/cipher_tiny.yaml",
                    "eddyrl/assets/cipher_warmstart/model.safetensors",
                    "eddyrl/configs/moe_tiny.yaml",
                    "eddyrl/assets/moe_warmstart/model.safetensors",
                    "eddyrl/platform_checks/contract.py", "eddyrl/platform_checks/runner.py"):
        assert shipped in names, shipped

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], outside, env)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / ("python.exe" if os.name == "nt" else "python")
    # this venv's pip, run by the new venv's interpreter (pip >= 22.3), installs into it
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          "-q", "--disable-pip-version-check", wheel], outside, env)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     outside, env).strip())
    (site / "zz_test_runner_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = _run([python, "-c", "import eddyrl, eddyrl.config.bundled_configs as b; "
                  "print(eddyrl.__file__); print(b.bundled_root())"], outside, env).split()
    assert Path(where[0]).resolve().is_relative_to(venv.resolve()), where
    assert Path(where[1]).resolve().is_relative_to(site.resolve()), where
    assert not Path(where[0]).resolve().is_relative_to(ROOT), where

    eddy = bin_dir / ("eddy.exe" if os.name == "nt" else "eddy")
    # the scenario, one step of 32 prompts (its 512 take ~15 s of simulation)
    out = _run([eddy, "sim", "dora_64", "loop.steps=1", "loop.batch_prompts=32"], outside, env)
    assert "step 1:" in out and "simulated" in out and "rollout idle" in out, out
    defaults = _run([eddy, "config", "show"], outside, env)
    assert "platform: auto" in defaults and "rollout:" in defaults, defaults
    replay = _run([eddy, "config", "show", "modes/replay"], outside, env)  # a bundled mode file
    assert "replay:" in replay and replay != defaults, replay
    # the platform contract from the wheel: the HAL hooks, two spawned ranks (which import the
    # wheel's copy) and the hf engine on the shipped tiny model (package data); the whole suite
    # takes ~30 s more, which the checkout's tests/integration/hal/test_platform_check_cli.py runs
    report = tmp_path / "checks.json"
    checks = _run([eddy, "platforms", "check", "cpu", "--only", "platform", "collective_ops",
                   "hf_generate", "--json", report], outside, env)
    results = json.loads(report.read_text())["results"]
    assert len(results) == 12 and {r["status"] for r in results} == {"passed"}, results
    assert "12 passed, 0 failed, 0 skipped" in checks, checks
    assert not any(outside.iterdir()), list(outside.iterdir())  # nothing written to the cwd

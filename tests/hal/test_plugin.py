"""A third-party platform is found through the `eddyrl.platforms` entry point and used with no
change to Eddy; a broken plug-in is a warning, not a crash."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "platform_plugin" / "eddy_example_platform"


def _site(tmp_path: Path, entry_points: str, name: str = "eddy_example_platform") -> Path:
    """A site directory holding the example package and the metadata pip would write for it,
    so `importlib.metadata` discovers the entry point exactly as for an installed plug-in."""
    site = tmp_path / "site"
    shutil.copytree(EXAMPLE, site / EXAMPLE.name)
    dist = site / f"{name}-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[eddyrl.platforms]\n{entry_points}\n")
    return site


def _run(site: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env,
                          timeout=300)


def test_example_plugin_is_listed(tmp_path):
    site = _site(tmp_path, "examplecpu = eddy_example_platform:ExampleCpuPlatform")
    out = _run(site, "-m", "eddyrl.cli", "platforms")
    assert out.returncode == 0, out.stderr
    assert "examplecpu" in out.stdout
    assert "cpu (auto)" in out.stdout  # only by name: it never displaces detection


def test_example_plugin_is_used_by_name_and_env(tmp_path):
    site = _site(tmp_path, "examplecpu = eddy_example_platform:ExampleCpuPlatform")
    code = ("from eddyrl.hal import get_platform\n"
            "from eddyrl.config import load_config\n"
            "from eddyrl.runtime.placement import resolve_role_platforms\n"
            "import torch\n"
            "p = get_platform()\n"
            "with p.profile_range('step'):\n"
            "    x = torch.ones(3, device=p.device()) * 2\n"
            "roles = resolve_role_platforms(load_config(overrides=['rollout.platform=examplecpu']))\n"
            "print(type(p).__name__, p.ranges, float(x.sum()), roles.rollout.name)\n")
    out = _run(site, "-c", code, env={"EDDY_PLATFORM": "examplecpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ExampleCpuPlatform", "['step']", "6.0", "examplecpu"]


def test_example_plugin_passes_the_contract_suite(tmp_path):
    site = _site(tmp_path, "examplecpu = eddy_example_platform:ExampleCpuPlatform")
    out = _run(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "examplecpu",
               str(ROOT / "tests" / "hal" / "test_contract.py"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "failed" not in out.stdout


@pytest.mark.parametrize("entry", ["broken = no_such_module:Platform",
                                   "notaplatform = eddy_example_platform:contextlib"])
def test_broken_plugin_warns_and_others_still_work(tmp_path, entry):
    site = _site(tmp_path, entry, name="broken_plugin")
    out = _run(site, "-m", "eddyrl.cli", "platforms")
    assert out.returncode == 0, out.stderr
    name = entry.split(" =")[0]
    assert f"platform plug-in {name!r}" in out.stderr and "skipped" in out.stderr
    assert "cpu (auto)" in out.stdout

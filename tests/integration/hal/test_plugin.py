"""A third-party platform is found through the `eddyrl.platforms` entry point and used with no
change to Eddy; a broken plug-in is a warning, not a crash."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "platform_plugin" / "eddy_example_platform"


def _site(tmp_path: Path, entry_points: str, name: str = "eddy_example_platform") -> Path:
    """A site directory holding the example package and the metadata pip would write for it,
    so `importlib.metadata` discovers the entry point exactly as for an installed plug-in."""
    site = tmp_path / "site"
    shutil.copytree(EXAMPLE, site / EXAMPLE.name)
    _dist(site, name, entry_points)
    return site


def _dist(site: Path, name: str, entry_points: str) -> None:
    """The metadata of one installed distribution `name` with these entry points."""
    dist = site / f"{name}-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[eddyrl.platforms]\n{entry_points}\n")


def _run(site: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env,
                          timeout=300)


ENTRY = "example = eddy_example_platform:ExamplePlatform"


def _hook_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_example_plugin_is_used_by_name_and_env(tmp_path):
    site = _site(tmp_path, ENTRY)
    log = tmp_path / "hooks.jsonl"
    code = ("from eddyrl.hal import get_platform\n"
            "from eddyrl.config import load_config\n"
            "from eddyrl.runtime.placement import resolve_role_platforms\n"
            "import torch\n"
            "p = get_platform()\n"
            "with p.profile_range('step'):\n"
            "    x = torch.ones(3, device=p.device()) * 2\n"
            "roles = resolve_role_platforms(load_config(overrides=['rollout.platform=example']))\n"
            "print(type(p).__name__, float(x.sum()), roles.rollout.name, p.device_count())\n")
    out = _run(site, "-c", code, env={"EDDY_PLATFORM": "example",
                                      "EXAMPLE_PLATFORM_LOG": str(log)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ExamplePlatform", "6.0", "example", "4"]
    assert [(h["hook"], h["name"]) for h in _hook_log(log)] == [("range_start", "step"),
                                                               ("range_end", "step")]


def test_example_plugin_passes_eddy_platforms_check(tmp_path):
    """The template passes the whole shipped contract, engines and collectives included."""
    site = _site(tmp_path, ENTRY)
    out = _run(site, "-m", "eddyrl.cli", "platforms", "check", "example", "--json",
               str(tmp_path / "checks.json"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    results = json.loads((tmp_path / "checks.json").read_text())
    assert results["platform"] == "example"
    statuses = {row["name"]: row["status"] for row in results["results"]}
    assert statuses and set(statuses.values()) == {"passed"}, statuses
    assert {"identity", "collective_ops", "hf_generate", "fsdp_train_step"} <= set(statuses)


# A vendor library half installed: each hook that discovery calls raises, in its own plug-in.
RAISING = '''
from eddyrl.hal.base import Platform


class _Acme(Platform):
    device_type = "cpu"
    detect_priority = 50  # detection asks it first, before the CPU


class RaisesInIsAvailable(_Acme):
    name = "raises_is_available"

    def is_available(self):
        raise OSError("libacme.so: cannot open shared object file")


class RaisesInReason(_Acme):
    name = "raises_reason"

    def unavailable_reason(self):
        raise ImportError("acme_runtime is only half installed")


class RaisesInConstructor(_Acme):
    name = "raises_constructor"

    def __init__(self):
        raise RuntimeError("acme driver version 0.0 is too old")
'''

RAISERS = {"raises_is_available": "OSError: libacme.so: cannot open shared object file",
           "raises_reason": "ImportError: acme_runtime is only half installed",
           "raises_constructor": "RuntimeError: acme driver version 0.0 is too old"}


def _raising_site(tmp_path: Path) -> Path:
    entries = "\n".join(f"{name} = raising_platforms:{cls}" for name, cls in (
        ("raises_is_available", "RaisesInIsAvailable"), ("raises_reason", "RaisesInReason"),
        ("raises_constructor", "RaisesInConstructor")))
    site = _site(tmp_path, entries, name="raising_plugins")
    (site / "raising_platforms.py").write_text(RAISING)
    return site


# Entry points that cannot be loaded, or load something that is not a Platform: skipped
BROKEN = ["broken = no_such_module:Platform", "notaplatform = eddy_example_platform:contextlib"]


def test_eddy_platforms_lists_the_plugin_and_survives_broken_and_raising_ones(tmp_path):
    """One `eddy platforms` over every kind of plug-in at once (each in its own distribution,
    as pip would install them): the example is listed; a broken entry point is a warning
    naming it and skipped; a plug-in whose hooks raise is listed as unavailable, with why, and
    a warning naming it; detection still picks the CPU."""
    site = _raising_site(tmp_path)
    _dist(site, "eddy_example_platform", ENTRY)
    for number, entry in enumerate(BROKEN):
        _dist(site, f"broken_plugin_{number}", entry)
    out = _run(site, "-m", "eddyrl.cli", "platforms")
    assert out.returncode == 0, out.stderr
    assert "example" in out.stdout and "EXAMPLE_DEVICE" in out.stdout
    # only by name: the example never displaces detection, nor do the broken ones
    assert "cpu (auto)" in out.stdout
    for entry in BROKEN:
        name = entry.split(" =")[0]
        assert f"platform plug-in {name!r}" in out.stderr and "skipped" in out.stderr, name
    for name, error in RAISERS.items():
        assert f"{name}: unavailable: " in out.stdout and error in out.stdout, name
        assert f"platform {name!r} is unusable" in out.stderr, name  # the warning names it
    assert "Traceback" not in out.stderr


def test_detection_and_a_run_by_name_survive_raising_plugins(tmp_path):
    site = _raising_site(tmp_path)
    code = ("from eddyrl.hal import detect, get_platform\n"
            "from eddyrl.errors import PlatformError\n"
            "print(detect().name)\n"
            "for name in ('raises_is_available', 'raises_reason', 'raises_constructor'):\n"
            "    try:\n"
            "        get_platform(name)\n"
            "    except PlatformError as exc:\n"
            "        print(exc)\n")
    out = _run(site, "-W", "ignore", "-c", code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "cpu"
    for line, (name, error) in zip(lines[1:], RAISERS.items()):
        assert line.startswith(f"platform {name!r} was requested but is not usable here: ")
        assert error in line


def test_the_hal_suite_collects_with_raising_plugins(tmp_path):
    site = _raising_site(tmp_path)
    out = _run(site, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
               str(ROOT / "tests" / "fast" / "hal" / "test_contract.py"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "raises_constructor" in out.stdout

"""`eddy platforms check NAME`: the shipped contract suite as a vendor runs it, in a fresh
process; a plug-in with one broken hook fails exactly that check; bad names are one clear
error. (The runner's selection and isolation, in this process: test_platform_check_runner.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eddyrl.platform_checks import CHECKS, names_in

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 540  # the whole suite in a subprocess, against a hang (it takes ~30 s idle)

BROKEN_PLUGIN = '''
from eddyrl.hal.cpu import CpuPlatform


class BrokenEventPlatform(CpuPlatform):
    name = "brokenevent"
    description = "host CPU whose events are broken on purpose"

    def new_event(self, enable_timing=False):
        raise RuntimeError("acme events are not implemented")
'''


def _site(tmp_path: Path) -> Path:
    """A site directory holding the plug-in and the metadata pip would write for it, so
    `importlib.metadata` finds its entry point as for an installed plug-in (spawned ranks
    included: they inherit PYTHONPATH)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "broken_event_platform.py").write_text(BROKEN_PLUGIN)
    dist = site / "broken_event_platform-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken_event_platform\n"
                                   "Version: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "[eddyrl.platforms]\nbrokenevent = broken_event_platform:BrokenEventPlatform\n")
    return site


def _check(*args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(str(p) for p in (site, ROOT) if p)
    return subprocess.run([sys.executable, "-m", "eddyrl.cli", "platforms", "check", *args],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONPATH": path})


def test_eddy_platforms_check_passes_with_a_row_per_check(platform, tmp_path):
    report = tmp_path / "checks.json"
    # On the CPU the engine checks run from the command line in the example plug-in's test
    # (tests/integration/hal/test_plugin.py, a CPU-backed platform) and in this process in
    # tests/fast/hal/test_contract.py: here the command's own work, once, is enough.
    selected = ["--only", "platform", "collectives"] if platform.device_type == "cpu" else []
    expected = [name for name in CHECKS if not selected or CHECKS[name].group != "engines"]
    out = _check(platform.name, *selected, "--json", str(report))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
    assert f"Eddy platform checks: {platform.name}" in out.stdout
    for name in expected:
        assert name in out.stdout, name
    results = json.loads(report.read_text())
    assert results["platform"] == platform.name
    assert [r["name"] for r in results["results"]] == expected
    statuses = {r["name"]: r["status"] for r in results["results"]}
    assert "failed" not in statuses.values(), statuses
    if platform.device_type == "cpu":  # nothing is out of reach on a CPU: no skips either
        assert set(statuses.values()) == {"passed"}, statuses
    assert f"{len(expected) - list(statuses.values()).count('skipped')} passed, 0 failed" \
        in out.stdout


def test_a_plugin_with_a_broken_hook_fails_exactly_that_check(tmp_path):
    report = tmp_path / "checks.json"
    # The platform hooks and the two spawned ranks (which must find the plug-in by name too);
    # the engines take the longest and are covered on the CPU above.
    out = _check("brokenevent", "--only", "platform", "collectives", "--json", str(report),
                 site=_site(tmp_path))
    assert out.returncode == 1, out.stdout[-6000:] + out.stderr[-6000:]
    results = {r["name"]: r for r in json.loads(report.read_text())["results"]}
    assert list(results) == names_in("platform") + names_in("collectives")
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    assert failed == ["streams_events"], results
    assert all(r["status"] == "passed" for name, r in results.items() if name not in failed)
    message = "RuntimeError: acme events are not implemented"
    assert results["streams_events"]["detail"] == message
    assert "new_event" in results["streams_events"]["traceback"]  # where, for the vendor
    assert f"FAILED streams_events: {message}" in out.stdout
    assert f"{len(results) - 1} passed, 1 failed, 0 skipped" in out.stdout


@pytest.mark.parametrize("args, message", [
    (("tpu",), "eddy: error: unknown platform 'tpu'; known platforms: "),
    (("cpu", "--only", "identity", "nosuchcheck"), "eddy: error: unknown check 'nosuchcheck'; "
                                                   "checks: identity, "),
], ids=["unknown-platform", "unknown-check"])
def test_a_bad_name_is_one_clear_error(args, message, capsys):
    # the command's own entry point in this process (what `python -m eddyrl.cli` runs, less
    # the interpreter's start): a name is refused before any check or process starts
    from eddyrl.cli import main

    assert main(["platforms", "check", *args]) == 2
    out = capsys.readouterr()
    assert out.err.startswith(message), out.err
    assert "Traceback" not in out.err and not out.out

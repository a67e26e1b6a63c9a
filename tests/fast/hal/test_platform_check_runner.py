"""The runner of `eddy platforms check`, in this process: checks are selected by name or group
in the registry's order, and each check is isolated, its failure saying the exception's type
and message (and, for a bare assert, the line and where). (The command itself, in a fresh
process: test_platform_check_cli.py.)"""

import importlib.util

import pytest

from eddyrl.platform_checks import CHECKS, Check, UnknownCheck, names_in, run_checks, select
from eddyrl.platform_checks import runner


def test_checks_are_selected_by_name_or_group_in_registry_order():
    assert [c.name for c in select(["tensors", "identity"])] == ["identity", "tensors"]
    assert [c.name for c in select(["engines"])] == names_in("engines")
    assert [c.name for c in select(None)] == list(CHECKS)
    assert {c.group for c in CHECKS.values()} == set(runner.GROUPS)
    with pytest.raises(UnknownCheck, match="unknown check 'memroy'; checks: identity, "):
        select(["memroy"])


VENDOR_CHECK = """
def bare_assert(platform):
    assert platform.device_count() < 0
"""


def test_each_check_is_isolated_and_its_failure_says_type_and_message(monkeypatch, tmp_path):
    def raises(platform):
        raise ValueError("the hook\nreturned nonsense")

    # A bare assert outside pytest's assertion rewriting (which would add a message), as in
    # the installed package or a vendor's own module.
    (tmp_path / "vendor_checks.py").write_text(VENDOR_CHECK)
    spec = importlib.util.spec_from_file_location("vendor_checks", tmp_path / "vendor_checks.py")
    vendor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vendor)
    monkeypatch.setitem(runner.CHECKS, "identity", Check("identity", "platform", raises))
    monkeypatch.setitem(runner.CHECKS, "rng", Check("rng", "platform", vendor.bare_assert))
    results = {r.name: r for r in run_checks("cpu", ["identity", "tensors", "rng", "autocast"])}
    assert list(results) == ["identity", "tensors", "rng", "autocast"]
    assert results["identity"].status == "failed"
    assert results["identity"].detail == "ValueError: the hook; returned nonsense"
    assert "raises" in results["identity"].traceback
    assert results["rng"].status == "failed"  # no message: the line that failed, and where
    assert results["rng"].detail == ("AssertionError: assert platform.device_count() < 0 "
                                     "(vendor_checks.py:3)")
    assert results["tensors"].status == results["autocast"].status == "passed"
    assert all(r.seconds >= 0 for r in results.values())

"""`eddy platforms`: the known platforms and which are usable here; `eddy platforms check NAME`:
the platform contract on one, as a pass/fail table."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_platforms(_: argparse.Namespace) -> int:
    from .hal import detect, get_platform, known_platforms
    from .ui import platforms_table

    rows = [get_platform(name, require_available=False).describe() for name in known_platforms()]
    platforms_table(rows, chosen=detect().name)
    return 0


def cmd_platforms_check(ns: argparse.Namespace) -> int:
    """The platform contract against one platform: a table, exit 1 when a check failed."""
    from .platform_checks import CHECKS, run_checks, select
    from .ui import platform_checks_table

    selected = select(ns.only)  # an unknown --only name fails here, before any check runs
    if any(check.group == "engines" for check in selected):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per model load would bury the progress
    total = len(selected)
    done: list = []

    def progress(result) -> None:
        done.append(result)
        print(f"[{len(done)}/{total}] {result.name}: {result.status} "
              f"({result.seconds:.1f} s)", file=sys.stderr, flush=True)

    results = run_checks(ns.name, ns.only, on_result=progress)
    platform_checks_table(ns.name, results, {name: c.summary for name, c in CHECKS.items()})
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"platform": ns.name, "results": [r.as_dict() for r in results]}, f,
                      indent=2)
    return 1 if any(r.status == "failed" for r in results) else 0

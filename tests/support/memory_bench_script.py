"""Shared by the bench/memory.py tests: the script loaded as a module (it is not part of the
package)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def memory_bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module

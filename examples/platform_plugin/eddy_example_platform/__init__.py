"""An example out-of-tree platform.

A vendor writes one class like this, registers it under the `eddyrl.platforms` entry-point group
(see pyproject.toml beside this package), runs Eddy's HAL contract tests against it, and every
`eddy` command can use it with `platform=<name>` — nothing else in Eddy changes.

This one runs on the host CPU so it can be tested anywhere; it overrides what a real accelerator
platform would (identity, profiling ranges) and inherits the rest.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from eddyrl.hal.cpu import CpuPlatform


class ExampleCpuPlatform(CpuPlatform):
    name = "examplecpu"
    description = "example plug-in platform (host CPU, records profiling ranges)"
    detect_priority = None  # only when asked for by name: never displaces a real device

    def __init__(self) -> None:
        self.ranges: list[str] = []  # what a vendor profiler would have received

    @contextlib.contextmanager
    def profile_range(self, name: str) -> Iterator[None]:
        self.ranges.append(name)
        yield

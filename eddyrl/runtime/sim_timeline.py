"""The simulator's record of what every worker did when: a Perfetto / Chrome trace and a PNG
timeline of worker activity and roles."""

from __future__ import annotations

# The trace format and its plot are shared with real runs (`eddy train` writes trace.json,
# `eddy report` plots it); they live in eddyrl/observability/trace.py.
from ..observability.trace import Trace as Timeline, _merged  # noqa: F401

__all__ = ["Timeline"]

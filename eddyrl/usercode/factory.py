"""The pool a mode names (`user_code.*.mode`): the one place that knows every pool class, so
that `pool.py`, which the thread and process pools build on, imports neither of them."""

from __future__ import annotations

from typing import Any

from .pool import InlinePool, Pool
from .processes import ProcessPool
from .threads import ThreadPool

POOLS: dict[str, type[Pool]] = {"thread": ThreadPool, "process": ProcessPool,
                                "inline": InlinePool}
MODES = tuple(POOLS)


def make_pool(mode: str, workers: int = 1, *, name: str = "user code",
              shared: Any = None) -> Pool:
    if mode not in POOLS:
        raise ValueError(f"user-code mode {mode!r} is not one of {', '.join(MODES)}")
    return POOLS[mode](workers, name=name, shared=shared)

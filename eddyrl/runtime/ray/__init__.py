"""Workers as Ray actors.

- `runtime.py`: `RayRuntime`, what the controller drives (the trainer ranks, the weight channel);
- `rollout_actors.py`: `RolloutActors`, the rollout workers' actors, lost and replaced;
- `calls.py`: `RayCalls`, every call named and under a deadline, its failure in one line
  (`errors.py` finds the cause); `trainer_calls.py`: `TrainerCalls`, the trainer ranks'
  calls together, a lost rank (`TrainerRankLost`) found among their failures;
- `lifecycle.py`: `start_ray` / `stop_ray`, the local Ray on loopback (`session.py`: its token
  and watch; `reaper.py`: its processes end with the driver) or a cluster joined (`connect.py`);
- `placement.py`: where Ray puts the actors (split / colocated).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lifecycle import start_ray, stop_ray
    from .runtime import RayRuntime

# Each name from its module on first use: those import torch (the workers, the platforms),
# which checking a config's `cluster.address` with connect.py must not wait for.
_FROM = {"RayRuntime": "runtime", "start_ray": "lifecycle", "stop_ray": "lifecycle"}
__all__ = list(_FROM)


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_FROM[name]}", __name__), name)

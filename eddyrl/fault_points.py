"""Named points in a worker's code where a test can make the process die, at an exact moment.

A fault test that signals a process from outside catches it only where it lingers (a training
step on the tiny model lasts long enough; a weight export or a checkpoint write does not).
These points kill the process from inside, at the point named, once: the same SIGKILL an
operator or a failing device would deliver, at a moment no polling could hit.

`EDDY_FAULT_POINTS` lists the faults, comma separated: `point:rank:version`, e.g.
`train_step:1:2` (trainer rank 1 dies in the step that starts from version 2). Each fires
once per run: before dying, the process creates `<EDDY_FAULT_POINTS_FIRED>/<fault>` (the
variable names a directory; without it no fault fires), so the replacement that reruns the
interrupted step passes the point. The variables travel to Ray's workers with the driver's
environment. Unset (every real run), `reached` is one dictionary lookup.

The points (`POINTS`): `train_step` (after the first micro-batch's backward: the other ranks
wait in the next collective), `weight_export` (in the export, after the buddy copy's fence),
`checkpoint_write` (between the model's files and the optimizer's).
"""

from __future__ import annotations

import os
import signal

POINTS = ("train_step", "weight_export", "checkpoint_write")
ENV, FIRED_ENV = "EDDY_FAULT_POINTS", "EDDY_FAULT_POINTS_FIRED"


def reached(point: str, rank: int, version: int) -> None:
    """Die here if a fault names this point, rank and version and has not fired yet."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault = f"{point}:{rank}:{version}"
    if fault not in parse(spec):
        return
    fired = os.environ.get(FIRED_ENV)
    if not fired:
        return
    try:  # exclusive: of two processes at the same point, one dies
        os.close(os.open(os.path.join(fired, fault.replace(":", "_")),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def parse(spec: str) -> set[str]:
    """The faults of `spec`, each checked: a misspelt point would never fire, silently."""
    faults = set()
    for fault in filter(None, (part.strip() for part in spec.split(","))):
        parts = fault.split(":")
        if len(parts) != 3 or parts[0] not in POINTS or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"{ENV}: {fault!r} is not point:rank:version with a point of "
                             f"{', '.join(POINTS)}")
        faults.add(fault)
    return faults

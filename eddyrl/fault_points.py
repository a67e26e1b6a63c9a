"""Named points in a worker's code where a test can make the process die, at an exact moment.

A fault test that signals a process from outside catches it only where it lingers (a training
step on the tiny model lasts long enough; a weight export or a checkpoint write does not).
These points kill the process from inside, at the point named, once: the same SIGKILL an
operator or a failing device would deliver, at a moment no polling could hit.

`EDDY_FAULT_POINTS` lists the faults, comma separated: `point:rank:version[:stop]`, e.g.
`train_step:1:2` (trainer rank 1 dies in the step that starts from version 2);
`train_step:0:4:stop` stops the process instead (SIGSTOP: alive, but taking no part, as a hung
device or a stuck kernel leaves it; the others' collectives time out). Each fires once per run: before dying, the process creates `<EDDY_FAULT_POINTS_FIRED>/<fault>` (the
variable names a directory; without it no fault fires), so the replacement that reruns the
interrupted step passes the point. The variables travel to Ray's workers with the driver's
environment. Unset (every real run), `reached` is one dictionary lookup.

The points (`POINTS`): `train_step` (after the first micro-batch's backward: the other ranks
wait in the next collective), `weight_export` (in the export, after the buddy copy's fence),
`checkpoint_write` (between the model's files and the optimizer's), `replica_step` (a rollout
worker lent to training as a gradient replica, as its share's gradients start: `rank` is
the rollout worker's index, `version` its replica's weights).
"""

from __future__ import annotations

import os
import signal

POINTS = ("train_step", "weight_export", "checkpoint_write", "replica_step")
ENV, FIRED_ENV = "EDDY_FAULT_POINTS", "EDDY_FAULT_POINTS_FIRED"


def reached(point: str, rank: int, version: int) -> None:
    """Die (or stop) here if a fault names this point, rank and version and has not fired."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault = f"{point}:{rank}:{version}"
    faults = parse(spec)
    if fault not in faults:
        return
    fired = os.environ.get(FIRED_ENV)
    if not fired:
        return
    try:  # exclusive: of two processes at the same point, one dies
        os.close(os.open(os.path.join(fired, fault.replace(":", "_")),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGSTOP if faults[fault] == "stop" else signal.SIGKILL)


def parse(spec: str) -> dict[str, str]:
    """The faults of `spec` (`point:rank:version` -> kill or stop), each checked: a misspelt
    point would never fire, silently."""
    faults = {}
    for fault in filter(None, (part.strip() for part in spec.split(","))):
        parts = fault.split(":")
        if len(parts) not in (3, 4) or parts[0] not in POINTS \
                or not all(p.isdigit() for p in parts[1:3]) or parts[3:] not in ([], ["stop"]):
            raise ValueError(f"{ENV}: {fault!r} is not point:rank:version[:stop] with a point "
                             f"of {', '.join(POINTS)}")
        faults[":".join(parts[:3])] = parts[3] if len(parts) == 4 else "kill"
    return faults

"""What to do after a run ended early (a stop, a lost worker, a full disk): the second half of
the CLI's last line. It must be true: `resume=auto` is advised only where `resume.find` (which
reads, never writes) would go on, and from the step it names; where it would refuse, its reason
is the advice; `checkpoint.every` is suggested only where it is not set.
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import checkpoints, resume
from .errors import EddyError


def how_to_go_on(run_dir: str, checkpoint_every: int) -> str:
    root = Path(run_dir) / resume.CHECKPOINTS
    if not checkpoints.step_dirs(root):
        return _no_checkpoint(run_dir, checkpoint_every)
    # their warnings (a checkpoint passed over) are for a run that starts: here the line says it
    quiet = [logging.getLogger(name) for name in (resume.__name__, checkpoints.__name__)]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        point = resume.find("auto", Path(run_dir))
    except EddyError as refused:  # a checkpoint none can go on from: why, and what instead
        return f"resume=auto would be refused here: {refused}"
    except OSError as unreadable:  # never hide the error this line follows behind another
        return f"resume=auto could not read the checkpoints under '{root}': {unreadable}"
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    if point is None:
        return _no_checkpoint(run_dir, checkpoint_every)
    return (f"resume with resume=auto run_dir={run_dir} (its newest good checkpoint is "
            f"step {point.step})")


def _no_checkpoint(run_dir: str, every: int) -> str:
    why = (f"checkpoint.every={every}: the first comes after step {every}" if every else
           "checkpoint.every=0 writes one at the end only; set checkpoint.every=N to make a "
           "run resumable")
    return (f"no checkpoint was written yet ({why}), so there is nothing to resume: start "
            f"again with another run_dir, or move '{run_dir}' away first")

"""A full disk (ENOSPC) or an exhausted quota (EDQUOT), found in whatever the error came wrapped
in, so that a run it ends says so in one line instead of a traceback.

The OSError rarely reaches the CLI as itself: torch.distributed.checkpoint gathers it into a
`CheckpointException` (a BaseException, its `failures` per rank), Ray wraps an actor's into a
`RayTaskError` (its `cause`; only the traceback's text when the cause did not pickle), the
cleanup that follows can raise again (its `__context__`), and safetensors reports one as text
("No space left on device (os error 28)"). `find` looks through all of those: the exception
objects first (they carry the file's name), the text of each after.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

FULL = (errno.ENOSPC, errno.EDQUOT)
# as Python words it ("[Errno 28] No space left on device: 'path'"), or Rust ("(os error 28)")
_TEXTS = {code: re.compile(rf"{re.escape(os.strerror(code))}(?:: '([^']+)')?|os error {code}\b")
          for code in FULL}
_MOST = 64  # exceptions looked at, at most (a chain is a few; this bounds a cycle's cost)


@dataclass(frozen=True)
class DiskFull:
    code: int  # errno.ENOSPC or errno.EDQUOT
    path: str | None  # the file being written, where the error names it

    def __str__(self) -> str:  # as Python words the OSError
        return f"OSError: [Errno {self.code}] {os.strerror(self.code)}" + \
            (f": '{self.path}'" if self.path else "")

    def line(self, run_dir: str) -> str:
        """What happened and what to do, the CLI's line (the resume advice follows)."""
        what = "the disk is full" if self.code == errno.ENOSPC else "the disk quota is used up"
        where = f"writing '{self.path}'" if self.path else f"writing in run_dir '{run_dir}'"
        return (f"{what} ({errno.errorcode[self.code]}: {os.strerror(self.code)}) {where}; "
                "free space there (or choose a run_dir on a disk with room)")


def find(exc: BaseException) -> DiskFull | None:
    """The full disk behind `exc`, however it was wrapped; None if there is none."""
    seen = _wrapped(exc)
    for each in seen:
        if isinstance(each, OSError) and each.errno in FULL:
            return DiskFull(each.errno, _name(each.filename))
    for each in seen:
        text = _text(each)
        for code, pattern in _TEXTS.items():
            match = pattern.search(text)
            if match:
                return DiskFull(code, match.group(1))
    return None


def _wrapped(exc: BaseException) -> list[BaseException]:
    """`exc` and every exception inside it, outermost first."""
    found: list[BaseException] = []
    todo = [exc]
    while todo and len(found) < _MOST:
        each = todo.pop(0)
        if not isinstance(each, BaseException) or any(each is f for f in found):
            continue
        found.append(each)
        todo += [each.__cause__, each.__context__, getattr(each, "cause", None)]
        failures = getattr(each, "failures", None)  # CheckpointException: rank -> (exc, trace)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += list(getattr(each, "exceptions", ()))  # an ExceptionGroup
    return found


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ hides nothing worth a second error
        return ""


def _name(filename: object) -> str | None:
    return os.fsdecode(filename) if isinstance(filename, (str, bytes)) else None

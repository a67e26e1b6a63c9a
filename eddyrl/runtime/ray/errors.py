"""A worker's failure on Ray as one line that starts with its cause.

Ray reports an exception raised in an actor as `ray::TrainerRank.save() (pid=..., ip=...)`
followed by the traceback, the reason last (and the root of a chain last but one segment up);
an actor whose `__init__` raised as "The actor died because of an error raised in its creation
task, ..." with that traceback inside. `cause_line` finds the reason: the innermost exception of
the chain first (`OSError: [Errno 28] No space left on device`), then the one it led to, if any;
an Eddy error's own message alone (it says what to do). The full text stays in the exception
chain (`__cause__`) and in the run's worker_errors.log.

Duck-typed on Ray's exception attributes (`cause`, `error_msg`, `actor_init_failed`): this module
imports no Ray, so its parsing is tested without it.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CHAINED = re.compile(r"\n\s*\n(?:The above exception was the direct cause of the following "
                      r"exception:|During handling of the above exception, another exception "
                      r"occurred:)\s*\n")
_HEADER = re.compile(r"^Traceback \(most recent call last\):|ray::\S+\(\) \(pid=")
_EDDY = re.compile(r"^eddyrl(?:\.\w+)*\.\w+Error: ")  # an Eddy error, named by its module
_DIED = "The actor is dead because"  # Ray's sentence for why an actor's process is gone
_ADVICE = " Some common causes"  # where Ray's advice (OOM killer, `ray stop`) begins


def plain(text: str) -> str:
    """Without Ray's terminal colours."""
    return _ANSI.sub("", text)


def exception_lines(text: str) -> list[str]:
    """The `Type: message` line (its first line) of every exception in a formatted traceback
    (Python's, or Ray's with a `ray::Actor.method() (pid=...)` header per exception), the
    innermost first."""
    found = []
    for segment in _CHAINED.split(plain(text)):
        rows = [row for row in segment.splitlines() if row.strip()]
        if rows and _HEADER.search(rows[0]):
            rows = rows[1:]
        line = next((row for row in rows if not row[0].isspace()), None)
        if line is not None:
            found.append(line.strip())
    return found


def _own_words(line: str) -> str:
    """An Eddy error's message without its type: the message is written to stand alone."""
    return _EDDY.sub("", line)


def cause_line(exc: BaseException) -> str:
    """One line for a Ray error, the reason first."""
    from ...errors import EddyError

    cause = getattr(exc, "cause", None)  # RayTaskError: the exception the actor raised
    if isinstance(cause, EddyError):
        return str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    text = plain(getattr(exc, "error_msg", None) or str(exc))
    if cause is not None or getattr(exc, "actor_init_failed", False):
        lines = exception_lines(text)
        if lines:
            root, last = _own_words(lines[0]), _own_words(lines[-1])
            if _EDDY.match(lines[-1]) or root == last:
                return last + (" (raised as the actor started)" if cause is None else "")
            return f"{root} (leading to {last})" + \
                (" (raised as the actor started)" if cause is None else "")
    rows = [row.strip() for row in text.splitlines() if row.strip()]
    if not rows:
        return type(exc).__name__
    died = next((row for row in rows if row.startswith(_DIED)), None)
    if died is not None:  # the process is gone: why, as far as Ray knows, without its advice
        return f"{rows[0]} {died.split(_ADVICE)[0]}"
    return rows[0]


def is_actor_death(exc: BaseException | None) -> bool:
    """Whether `exc` is Ray's error for an actor whose process is gone (`ActorDiedError`),
    not one whose `__init__` raised, nor one only unreachable for now (`ActorUnavailableError`)."""
    return type(exc).__name__ == "ActorDiedError" and not getattr(exc, "actor_init_failed", True)


_FIELD = re.compile(r"^\s*(pid|ip): (\S+)\s*$", re.MULTILINE)  # Ray's lines of a dead actor


def death_reason(text: str) -> str:
    """Why Ray says an actor's process is gone ("The actor is dead because its worker process
    has died. Worker exit type: ..."), without its advice; the first line where it says none."""
    rows = [row.strip() for row in plain(text).splitlines() if row.strip()]
    died = next((row for row in rows if row.startswith(_DIED)), None)
    if died is not None:
        return died.split(_ADVICE)[0].strip()
    return rows[0] if rows else ""


def death_fields(text: str) -> dict[str, str]:
    """The `pid` and `ip` Ray names in a dead actor's error, where it names them."""
    return dict(_FIELD.findall(plain(text)))


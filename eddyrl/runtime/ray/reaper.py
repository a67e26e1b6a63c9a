"""The reaper of one local Ray session: `python reaper.py LOGS TOKEN_DIR KIND=PID...`,
started by the driver right after `ray.init` with Ray's log directory, the session's token
directory ("-": none) and the processes Ray started (GCS, raylet, monitors), its stdin the read
end of a pipe that only the driver holds.

Ray starts its GCS and raylet with a parent-death signal, so they die with the driver; what the
raylet starts does not. Its dashboard and runtime-env agents notice the raylet gone, then spend
about a minute trying to report to the dead GCS, one of them still listening; a worker can
linger too. So this process follows the session's process tree (those PIDs and everything under
them, read from /proc) while the driver lives, and when its stdin reads EOF (the driver closed
it after `ray.shutdown`, or died) it kills, by PID, every process of that tree still alive. A
PID counts as the same process only with the same start time: a reused PID is never hit.
Then it removes the token directory, which a dead driver cannot.
Nothing outside the tree is touched. Ctrl-C and a terminal's hang-up are the driver's to
handle: the driver starts this in a session of its own, and it ignores SIGINT.

It also has the last word when the driver cannot: the driver writes `lost <why>` when it sees
the GCS or raylet die and `bye` when it stops normally. A driver that dies without `bye` after
`lost` gets its line printed here (on the stderr they share); so does one that Ray itself ended
for a lost raylet (its core worker exits at once, without a word, when its connection to the
object store breaks) or a lost GCS, as the driver's own Ray log says.

Linux only (/proc); the standard library only, so that it starts in a few milliseconds.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys

INTERVAL_S = 0.5  # how often the tree is read again while the driver lives
NAMES = {"gcs_server": "GCS server", "raylet": "raylet"}  # what a run cannot lose
# what Ray's core worker logs as it ends the driver for a lost raylet (its object store) or GCS
DRIVER_ENDED_BY = {"connection to the plasma store is failed": "raylet",
                   "Failed to connect to GCS": "gcs_server"}


def lost_line(kind: str, pid: int, how: str, logs: str) -> str:
    """The one line for a run that lost Ray's GCS or raylet."""
    return (f"Ray's {NAMES[kind]} ({kind}, pid {pid}) {how}; the run cannot go on without it: "
            "run it again with resume=auto (same run_dir) to go on from its last checkpoint "
            f"(Ray's logs: {logs})")


def ended_by_ray(logs: str, driver: int) -> str | None:
    """The kind of process whose loss made Ray end the driver, from the driver's Ray log."""
    try:
        names = [n for n in os.listdir(logs)
                 if n.startswith("python-core-driver-") and n.endswith(f"_{driver}.log")]
        with open(os.path.join(logs, names[0]), "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 65536))
            tail = log.read().decode(errors="replace")
    except (OSError, IndexError):
        return None
    return next((kind for text, kind in DRIVER_ENDED_BY.items() if text in tail), None)


def processes() -> dict[int, tuple[int, int, str]]:
    """Every process: pid -> (parent pid, start time in clock ticks, state letter)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                data = stat.read()
        except OSError:  # gone meanwhile
            continue
        fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) "; comm may hold ")"
        table[int(name)] = (int(fields[1]), int(fields[19]), fields[0].decode())
    return table


def follow(tracked: dict[int, int], table: dict[int, tuple[int, int, str]]) -> None:
    """Add to `tracked` (pid -> start time) every live descendant of a tracked process."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = [pid for pid, start in tracked.items() if _same(pid, start, table)]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tracked:
                tracked[child] = table[child][1]
                todo.append(child)


def _same(pid: int, start: int, table: dict[int, tuple[int, int, str]]) -> bool:
    """Whether `pid` is still the process that started at `start`, and not a zombie."""
    entry = table.get(pid)
    return entry is not None and entry[1] == start and entry[2] != "Z"


def reap(tracked: dict[int, int]) -> list[int]:
    """SIGKILL every tracked process still alive; returns their PIDs."""
    table = processes()
    follow(tracked, table)
    killed = []
    for pid, start in tracked.items():
        if pid != os.getpid() and _same(pid, start, table):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:  # exited meanwhile
                pass
    return killed


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    driver, logs, token_dir = os.getppid(), argv[0], argv[1]
    roots = {int(pid): kind for kind, pid in (arg.split("=", 1) for arg in argv[2:])}
    table = processes()
    tracked = {pid: table[pid][1] for pid in roots if pid in table}
    said, clean, pending = None, False, b""
    while True:
        ready, _, _ = select.select([0], [], [], INTERVAL_S)
        if ready:
            data = os.read(0, 4096)
            if not data:  # EOF: the driver is done, or dead
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                clean = clean or line == b"bye"
                said = line[5:].decode() if line.startswith(b"lost ") else said
        follow(tracked, processes())
    reap(tracked)
    if os.path.basename(token_dir).startswith("eddy-ray-token-"):  # never anything else
        shutil.rmtree(token_dir, ignore_errors=True)
    if not clean:  # the driver died: did it lose Ray first?
        kind = None if said else ended_by_ray(logs, driver)
        pid = next((p for p, k in roots.items() if k == kind), None)
        if kind is not None and pid is not None:
            said = lost_line(kind, pid, f"died, and Ray ended the driver (pid {driver})", logs)
        if said:
            print(f"eddy: error: {said}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

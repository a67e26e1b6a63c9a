"""Ending what a two-host fixture (`hosts.py`) made: every process in its network namespaces,
then the namespaces themselves (their veth goes with them) and its shared directory.

Standard library only: `hosts.py` imports it for its own teardown, and runs it as a watchdog
(`python -I netns_reaper.py NETNS... [--rmtree DIR]`) that waits for EOF on its stdin and then
cleans up. The fixture holds the pipe's other end, so a test process killed outright (no
finalizers) still leaves nothing behind; after a normal teardown the watchdog finds nothing.

A process belongs to a host when its network namespace (or, its main thread gone, one of its
threads') is that host's (the same inode as /run/netns/NAME): the namespaces are made by the
fixture, with names no one else uses, so every process in them was started by it, however Ray
daemonized them. Nothing else is killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterable, Iterator

NETNS_DIR = "/run/netns"


def netns_id(name: str) -> tuple[int, int] | None:
    """(device, inode) of a named network namespace, or None if it does not exist."""
    try:
        info = os.stat(os.path.join(NETNS_DIR, name))
    except OSError:
        return None
    return info.st_dev, info.st_ino


@contextlib.contextmanager
def held(names: Iterable[str]) -> Iterator[list[tuple[int, int]]]:
    """The ids of these namespaces, each held open (a file descriptor) until the block ends.
    The kernel gives a freed namespace's inode number to the next namespace made anywhere on
    the machine (another copy of the suite makes them all the time): an id looked at after
    its namespace is deleted names that namespace alone only while it is held."""
    fds: list[int] = []
    try:
        for name in names:
            fds.append(os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC))
        yield [(info.st_dev, info.st_ino) for info in map(os.fstat, fds)]
    finally:
        for fd in fds:
            os.close(fd)


def netns_of(pid: int | str) -> set[tuple[int, int]]:
    """The network namespaces of a process: its main thread's; or, once that thread has
    exited while others still run, theirs. A multi-threaded process killed ends that way: its
    main thread can be gone (a zombie, no namespace) while another still closes its files,
    for seconds on a loaded machine; taken for gone, it kept the host's /tmp busy. Empty for
    a process that is gone or wholly a zombie."""
    try:
        info = os.stat(f"/proc/{pid}/ns/net")
        return {(info.st_dev, info.st_ino)}
    except OSError:
        pass
    found = set()
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone
        return found
    for tid in threads:
        try:
            info = os.stat(f"/proc/{pid}/task/{tid}/ns/net")
        except OSError:  # gone, or exited
            continue
        found.add((info.st_dev, info.st_ino))
    return found


def pids_in(ns_id: tuple[int, int] | None) -> set[int]:
    """The processes with a live thread in network namespace `ns_id` (`netns_of`)."""
    if ns_id is None:
        return set()
    return {int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and ns_id in netns_of(entry)}


def _signal(pid: int, ns_id: set[tuple[int, int]], how: signal.Signals) -> None:
    """Signal `pid` if it is still in one of these namespaces: through a pidfd, checked after
    it is opened, so that a PID reused meanwhile by another process is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone
        return
    try:
        if netns_of(pid) & ns_id:
            signal.pidfd_send_signal(fd, how)  # to the whole process, every thread
    except OSError:
        pass
    finally:
        os.close(fd)


def kill_all(ns_ids: list[tuple[int, int] | None], grace_s: float = 2.0,
             timeout_s: float = 60.0, keep: frozenset[int] = frozenset()) -> set[int]:
    """SIGTERM every process in these namespaces (but `keep`), SIGKILL what is still there
    `grace_s` later, until none is left or `timeout_s`. Returns what is still alive (normally
    nothing). A process forked meanwhile is found by the next pass."""
    wanted = {ns for ns in ns_ids if ns is not None}
    start = time.monotonic()
    first_seen: dict[int, float] = {}
    while True:
        alive = set().union(set(), *(pids_in(ns) for ns in wanted)) - set(keep)
        now = time.monotonic()
        if not alive or now - start > timeout_s:
            return alive
        for pid in alive:
            if pid not in first_seen:
                first_seen[pid] = now
                _signal(pid, wanted, signal.SIGTERM)
            elif now - first_seen[pid] >= grace_s:
                _signal(pid, wanted, signal.SIGKILL)
        time.sleep(0.1)


def delete_netns(names: list[str]) -> list[str]:
    """`ip netns del` each that exists; returns errors (empty when all went)."""
    errors = []
    for name in names:
        if netns_id(name) is None:
            continue
        done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
        if done.returncode != 0 and netns_id(name) is not None:
            errors.append(f"ip netns del {name}: {done.stderr.strip()}")
    return errors


def reap(names: list[str], rmtree: str | None = None) -> list[str]:
    """Everything in these namespaces killed, the namespaces deleted, `rmtree` removed.
    Idempotent; returns what could not be done."""
    ns_ids = [netns_id(name) for name in names]
    problems = [f"pid {pid} survived SIGKILL" for pid in sorted(kill_all(ns_ids))]
    problems += delete_netns(names)
    if rmtree:
        shutil.rmtree(rmtree, ignore_errors=True)
    return problems


def main(argv: list[str]) -> int:
    rmtree = None
    if "--rmtree" in argv:
        at = argv.index("--rmtree")
        rmtree = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the fixture's to handle
    try:
        while sys.stdin.buffer.read(4096):  # EOF: the fixture closed the pipe, or died
            pass
    except OSError:
        pass
    problems = reap(argv, rmtree)
    for line in problems:
        print(f"netns_reaper: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Two copies of the test suite at once on one machine (issue 32): each two-host fixture keeps
to its own namespaces, subnet and mounts, and its teardown ends only what it made. No Ray, no
model: only the hosts (a second or two each)."""

from __future__ import annotations

import ipaddress
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import netns_reaper, subnets
from .hosts import TwoHosts

ROOT = Path(__file__).resolve().parents[2]

# The other copy of the suite: a process with a fixture of its own, driven through its stdin
# (one JSON command a line, one JSON answer a line); EOF closes its hosts.
OTHER_COPY = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from tests.multinode.hosts import TwoHosts

hosts = TwoHosts().start()
print(json.dumps({{"netns": hosts.netns, "subnet": str(hosts.subnet),
                   "addresses": [h.address for h in hosts.hosts],
                   "anchors": [h.anchor.pid for h in hosts.hosts]}}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if "python" in command:
        answer = hosts[command["host"]].python(command["python"]).stdout.strip()
    else:  # "link": B reaches A (what the start checks), and nothing is left over yet
        hosts._check_link()
        answer = "ok"
    print(json.dumps(answer), flush=True)
try:
    hosts.close()
    print(json.dumps("closed"), flush=True)
except Exception as error:
    print(json.dumps(str(error)), flush=True)
"""

# How `address` answers from inside a host: ECONNREFUSED (reached: nothing listens on port 9),
# ENETUNREACH (no route to it). Only the fixtures' own addresses are ever tried.
REACH = """
import errno, socket
s = socket.socket()
s.settimeout(60)
try:
    s.connect(({address!r}, 9))
    print("connected")
except OSError as error:
    print(errno.errorcode.get(error.errno, repr(error)))
"""


class OtherCopy:
    def __init__(self, log: Path) -> None:
        self.log = log.open("w")
        self.process = subprocess.Popen([sys.executable, "-c", OTHER_COPY], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True)

    def answer(self):
        line = self.process.stdout.readline()
        assert line, f"the other copy ended: {self.log.name}"
        return json.loads(line)

    def ask(self, **command):
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> str:
        self.process.stdin.close()
        answer = self.answer()
        self.process.wait(timeout=300)
        return answer

    def kill(self) -> None:  # a failed test: its watchdog still ends what its hosts made
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def _mounts_naming(names) -> list[str]:
    """The mounts that name one of these network namespaces: a host's tmpfs (its source is
    the netns's name) in any process's mount namespace, and the netns's binding under
    /run/netns in this process's. (Another process's copy of that binding, made by an
    `unshare --mount` of its own meanwhile, is its own and not looked at.)"""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            lines = (entry / "mountinfo").read_text().splitlines()
        except OSError:  # gone
            continue
        for line in lines:
            fstype, source = (line.split(" - ", 1)[1].split() + ["", ""])[:2]
            if fstype == "tmpfs" and source in names:
                found.append(f"pid {entry.name}: {line}")
    own = Path("/proc/self/mountinfo").read_text().splitlines()
    return found + [line for line in own if any(name in line for name in names)]


def _gone(netns, ns_ids, subnet) -> None:
    """Nothing of one fixture is left: no namespace by that name or process in it, no mount
    naming it, its subnet free again."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in netns), listed
    assert all(netns_reaper.pids_in(ns) == set() for ns in ns_ids)
    assert _mounts_naming(netns) == []
    claim = subnets.claim(subnet)
    assert claim is not None, f"{subnet} is still held"
    claim.close()


def test_two_fixtures_at_once_keep_to_their_own_hosts_and_tear_down_only_their_own(
        multinode_available, tmp_path):
    """Before: every fixture took the first free subnet of a fixed list, the same one for two
    copies of the suite, and its teardown missed a dying process whose main thread had ended
    (the test below): beside another copy, `umount ... target is busy` and the multi-node
    tests failed. Now: two fixtures set up at the same moment, one in another process, get
    their own namespaces, subnet and /tmp; each pair reaches itself and not the other; closing
    one leaves the other working, and both leave nothing behind."""
    other = OtherCopy(tmp_path / "other-copy.log")  # starting while this one starts
    try:
        with TwoHosts() as mine:
            theirs = other.answer()
            assert not set(mine.netns) & set(theirs["netns"])
            their_subnet = ipaddress.ip_network(theirs["subnet"])
            assert not mine.subnet.overlaps(their_subnet), (mine.subnet, their_subnet)
            assert {h.address for h in mine.hosts} <= set(map(str, mine.subnet.hosts()))

            # each pair reaches itself, neither reaches the other
            a_to_b = REACH.format(address=mine.b.address)
            assert mine.a.python(a_to_b).stdout.strip() == "ECONNREFUSED"
            assert other.ask(host="A", python=REACH.format(address=theirs["addresses"][1])) \
                == "ECONNREFUSED"
            for address in theirs["addresses"]:
                assert mine.a.python(REACH.format(address=address)).stdout.strip() \
                    == "ENETUNREACH"
            for host in mine.hosts:
                assert other.ask(host="B", python=REACH.format(address=host.address)) \
                    == "ENETUNREACH"

            # and neither sees the other's /tmp
            mine.a.run(["sh", "-c", "echo mine > /tmp/whose"])
            their_a = Path(f"/proc/{theirs['anchors'][0]}/root/tmp")
            assert not (their_a / "whose").exists()
            assert their_a.stat().st_dev != mine.a.path("/tmp").stat().st_dev

            with netns_reaper.held(mine.netns) as my_ids:
                mine.close()
                assert mine.leftovers() == []
                _gone(mine.netns, my_ids, mine.subnet)
        # the other copy's hosts are untouched by this one's teardown
        assert other.ask(link=True) == "ok"
        with netns_reaper.held(theirs["netns"]) as their_ids:
            assert other.close() == "closed"
            assert other.process.returncode == 0
            _gone(theirs["netns"], their_ids, their_subnet)
    finally:
        other.kill()


# SYS_exit: the calling thread alone ends (glibc's exit() ends them all)
SYS_EXIT = {"x86_64": 60, "aarch64": 93}

MAIN_THREAD_ENDS_FIRST = """
import ctypes, threading, time
opened = threading.Event()

def hold():
    held = open("/tmp/held-open", "w")  # on the host's /tmp, as is the working directory
    opened.set()
    time.sleep(3600)

threading.Thread(target=hold).start()
opened.wait()
print("ready", flush=True)
ctypes.CDLL(None).syscall({sys_exit}, 0)
"""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_a_host_process_whose_main_thread_ended_first_is_killed_before_the_unmount(
        multinode_available):
    """Before: teardown found a host's processes by their main thread's namespace. A killed
    multi-threaded process (Ray's daemons, a trainer) can lose its main thread first while
    another thread still frees its memory and closes its files, for seconds on a machine
    loaded by a second copy of the suite: teardown took it for gone, unmounted the host's /tmp
    under it and failed with `umount: /tmp: target is busy`. Here that state is made and held
    (the main thread ends by SYS_exit, a thread keeps a file open in /tmp): teardown must find
    the process, kill it, and unmount cleanly."""
    sys_exit = SYS_EXIT.get(platform.machine())
    if sys_exit is None:
        pytest.skip(f"SYS_exit's number on {platform.machine()} is not known here")
    hosts = TwoHosts().start()
    process = None
    try:
        process = hosts.a.popen(
            [sys.executable, "-c", MAIN_THREAD_ENDS_FIRST.format(sys_exit=sys_exit)],
            stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 120
        while _state(process.pid) != "Z":  # the main thread has ended, the process has not
            assert time.monotonic() < deadline, f"state {_state(process.pid)}"
            time.sleep(0.05)
        assert process.pid in hosts.a.pids()
        hosts.close()
        assert process.poll() is not None
        assert hosts.leftovers() == []
    finally:
        if process is not None:
            if process.poll() is None:  # our own child: its PID is ours until waited for
                process.kill()
                process.wait(timeout=60)
            process.stdout.close()
        try:
            hosts.close()
        except Exception:
            pass  # the test has failed already

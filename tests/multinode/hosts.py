"""Two "hosts" on this one machine, and a real two-node Ray cluster across them (issue 21).

A host is a network namespace of its own (`ip netns add`; loopback, one end of a veth pair
and a private address) plus a mount namespace of its own with a fresh tmpfs on /tmp, held by
one anchor process (`sleep infinity`). Commands run in a host through
`nsenter --net=/run/netns/NS --mount=/proc/ANCHOR/ns/mnt`, so they see that host's network
only, and a /tmp (and $HOME, /tmp/home) that neither the other host nor the test process
sees. The rest of the filesystem is shared, /work (the repository and its venv: "the software
installed on every node") and /dev/shm (where the fixture keeps what both hosts must read,
such as the Ray token) included; so are the PIDs, the hostname and /sys.

    with TwoHosts() as hosts:                        # A = hosts.a, B = hosts.b
        hosts.b.run(["sh", "-c", "echo hi > /tmp/x"])
        hosts.a.python("import os; print(os.path.exists('/tmp/x'))")  # False
        cluster = RayCluster(hosts, num_cpus={"A": 1, "B": 2},
                             resources={"B": {"gpu_like": 4}}).start()
        cluster.driver("import os, ray; ray.init(address=os.environ['MULTINODE_RAY_ADDRESS'])")
    # everything the hosts ran is killed, the namespaces (and the veth) are gone

Teardown kills, by PID, every process in the two network namespaces, and nothing else: the
namespaces are this fixture's own (names with the test process's PID and a random part), so
whatever runs in them was started here, however Ray daemonized it. A watchdog process
(`netns_reaper.py`) does the same should the test process die without its finalizers.
Each gets SIGTERM, then SIGKILL 2 s later (Ray's GCS, raylets and agents outlast a SIGTERM by
more than 6 s here anyway; nothing of theirs needs a clean exit: /tmp goes with the host).
Never `ray stop`: it kills every Ray process of the user on the machine. Another copy of the
suite may run at once: its fixtures have namespaces, a subnet (`subnets.py`) and mounts of
their own, and teardown waits for a dying process's last thread (`netns_reaper.netns_of`).

Ray runs with token authentication on (RAY_AUTH_MODE=token, one fresh token in a 0600 file that
both hosts read through RAY_AUTH_TOKEN_PATH), without its dashboard, and its workers at
niceness 0. `ray start --head` alone would enable token mode only because a token is found;
`ray start --address` (the worker node) does not: without RAY_AUTH_MODE it connects without
the token and the GCS refuses it ("Authentication token is missing or incorrect"), hence
RAY_AUTH_MODE on both. Ray 2.60 binds its servers to a node IP only when that is loopback:
here the GCS, the raylets, workers' gRPC servers and the autoscaler's metrics port listen on
the wildcard of their host (which, in a host, means its veth address and loopback).

The API (fixtures in conftest.py):
- `TwoHosts()`: `.start()` / `.close()` or `with`; `.a`, `.b`, `["A"]`; `.shared_dir` (seen
  by both hosts and the test); `.stop_processes(host)`; `.leftovers()` (empty once closed).
- `Host`: `.address`, `.netns`; `.popen(argv, env=, cwd=, **Popen kwargs)`, `.run(argv,
  env=, cwd=, timeout=, check=, input=)`, `.python(code, ...)`: inside the host (`env`: extra
  variables on the host's environment, None removes one); `.path("/tmp/x")`: the host's file
  as the test opens it; `.pids()`; `.listeners()`.
- `RayCluster(hosts, num_cpus={"A": 1, "B": 1}, resources={"B": {...}}, port=6379,
  node_env={"B": {...}})`:
  `.start()` (both nodes alive), `.address`, `.env()`, `.driver(code, host=A)`,
  `.driver_json(code)` (the last line printed with JSON_MARK), `.wait_nodes(n)`,
  `.stop_node(host)`, `.stop()`, `.ray_logs(host)`, `.startup_s` (measured).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from . import netns_reaper, subnets

REAPER = Path(netns_reaper.__file__).resolve()
VENV_BIN = Path(sys.executable).parent
RAY = VENV_BIN / "ray"
SHARED_ROOT = "/dev/shm"  # visible to both hosts and to the test process (a tmpfs)
HOST_HOME = "/tmp/home"  # per host: nothing falls back to the test process's ~/.ray
HOST_WORKDIR = "/tmp/work"  # per host: the default working directory of its commands
JSON_MARK = "MULTINODE_JSON "  # the line `RayCluster.driver_json` reads back
START_TIMEOUT_S = 240.0  # for the whole cluster: `ray start` takes 30-60 s on a busy 2-core VM
START_ATTEMPTS = 3  # `ray start` of a cluster (RayCluster.start says why more than one)
UNMOUNT_WAIT_S = 30.0  # how long teardown tries again to unmount a host's busy /tmp (_unmount)
# Not passed to a host: the test process's own Ray, etc., and the collective libraries'
# interface variables (tests run in this process set them to loopback: a host's gloo would
# then listen on its loopback, and its peer on the other host could never connect).
_STRIPPED_ENV = ("RAY_", "PYTEST_", "GLOO_SOCKET_", "NCCL_SOCKET_", "HCCL_SOCKET_", "HCCL_IF_IP")


def _code_under_tmp() -> list[str]:
    """The software a host must see that lives under /tmp (a checkout, its venv, PYTHONPATH
    entries: CI may clone there): each host's private /tmp would hide it, so the anchor binds
    it back, at the same path (it plays the software installed on every node, like /work)."""
    import eddyrl

    paths = {os.path.realpath(sys.prefix), str(Path(eddyrl.__file__).resolve().parents[1])}
    paths |= {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p}
    under = sorted(p for p in paths if p.startswith("/tmp/") and os.path.isdir(p))
    return [p for p in under if not any(p.startswith(q + "/") for q in under)]  # outermost


class HostError(RuntimeError):
    pass


class HostCommandError(HostError):
    def __init__(self, host: str, argv: Sequence[str], code: int | None, stdout: str,
                 stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = code, stdout, stderr
        super().__init__(f"on host {host}: {' '.join(map(str, argv))[:300]} "
                         f"{'timed out' if code is None else f'exited with {code}'}\n"
                         f"--- stdout (tail)\n{stdout[-3000:]}\n--- stderr (tail)\n"
                         f"{stderr[-3000:]}")


# --------------------------------------------------------------------------------- probing

_PROBED: list[str | None] = []


def probe() -> str | None:
    """None if network and mount namespaces can be made here, else why not (once a process)."""
    if not _PROBED:
        _PROBED.append(_probe())
    return _PROBED[0]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (this test process is not)"
    for tool in ("ip", "unshare", "nsenter", "mount", "umount", "mountpoint", "sh", "sleep"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if not os.path.isdir(SHARED_ROOT):
        return f"{SHARED_ROOT} does not exist (the hosts' shared directory)"
    if not hasattr(os, "pidfd_open"):
        return "os.pidfd_open is missing (teardown signals through pidfds)"
    name = f"eddy-mn-probe-{os.getpid()}-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    try:
        inside = subprocess.run(
            ["nsenter", f"--net={netns_reaper.NETNS_DIR}/{name}", "--", "unshare", "--mount",
             "--propagation", "private", "--", "sh", "-c", "mount -t tmpfs probe /tmp"],
            capture_output=True, text=True, timeout=60)
        if inside.returncode != 0:
            return ("a mount namespace with a tmpfs on /tmp could not be made: "
                    f"{inside.stderr.strip() or inside.returncode}")
    finally:
        problems = netns_reaper.reap([name])
    if problems:
        return f"the probe's network namespace could not be removed: {problems}"
    return None


# ----------------------------------------------------------------------------------- a host

@dataclass(frozen=True)
class Listener:
    proto: str  # tcp, tcp6, udp, udp6
    ip: str
    port: int
    pids: tuple[int, ...]
    names: tuple[str, ...]  # the processes' command names (comm)

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.ip).is_unspecified

    def __str__(self) -> str:
        ip = f"[{self.ip}]" if ":" in self.ip else self.ip
        owners = ", ".join(f"{n} (pid {p})" for p, n in zip(self.pids, self.names))
        return f"{self.proto} {ip}:{self.port} {owners or '(no process found)'}"


def _proc_ip(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    # /proc/net prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = getattr(address, "ipv4_mapped", None)  # a dual-stack socket's IPv4 address
    return f"::ffff:{mapped}" if mapped else str(address)


class Host:
    """One host: its network namespace and its anchor's mount namespace."""

    def __init__(self, label: str, netns: str, address: str, prefixlen: int,
                 shared_dir: Path) -> None:
        self.label, self.netns, self.address = label, netns, address
        self.prefixlen, self.shared_dir = prefixlen, shared_dir
        self.home, self.workdir = HOST_HOME, HOST_WORKDIR
        self.anchor: subprocess.Popen | None = None
        self._started: list[subprocess.Popen] = []  # what popen() started, waited for at close

    def __repr__(self) -> str:
        return f"Host({self.label}, {self.address}, netns={self.netns})"

    # ---- entering the host -----------------------------------------------------------------
    def command(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """`argv` as run inside this host (cwd: a path as the host sees it)."""
        if self.anchor is None or self.anchor.poll() is not None:
            raise HostError(f"host {self.label} is not running (its anchor is gone)")
        return ["nsenter", f"--net={netns_reaper.NETNS_DIR}/{self.netns}",
                f"--mount=/proc/{self.anchor.pid}/ns/mnt", f"--wdns={cwd or self.workdir}",
                "--", *map(str, argv)]

    def env(self, extra: dict[str, str | None] | None = None) -> dict[str, str]:
        """The host's environment: the test process's without RAY_* and PYTEST_*, the venv
        first on PATH, HOME and TMPDIR of the host's own; `extra` on top (None removes)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED_ENV)}
        env.update(PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
                   HOME=self.home, TMPDIR="/tmp", PYTHONUNBUFFERED="1")
        env.pop("TMP", None), env.pop("TEMP", None)
        for key, value in (extra or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def popen(self, argv: Sequence[str], *, env: dict[str, str | None] | None = None,
              cwd: str | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start `argv` in this host (env: extra variables, see `env`). Its own session, like a
        process on another machine: a Ctrl-C at the terminal does not reach it."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        process = subprocess.Popen(self.command(argv, cwd), env=self.env(env), **kwargs)
        self._started.append(process)
        return process

    def run(self, argv: Sequence[str], *, env: dict[str, str | None] | None = None,
            cwd: str | None = None, timeout: float = 120.0, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run `argv` in this host to its end (text output captured). HostCommandError, with
        the output, if it fails (check) or outlives `timeout` (then it is killed)."""
        process = self.popen(argv, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            raise HostCommandError(self.label, argv, None, stdout, stderr) from None
        if check and process.returncode != 0:
            raise HostCommandError(self.label, argv, process.returncode, stdout, stderr)
        return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)

    def python(self, code: str, **kwargs: Any) -> subprocess.CompletedProcess:
        """`python -c code` in this host (the venv's Python); keywords as `run`."""
        return self.run([sys.executable, "-c", textwrap.dedent(code)], **kwargs)

    # ---- looking at the host from outside --------------------------------------------------
    def path(self, inside: str | os.PathLike) -> Path:
        """A path of this host's filesystem as the test process can open it (through its
        anchor's root: `host.path("/tmp/x").read_text()`)."""
        if self.anchor is None:
            raise HostError(f"host {self.label} is not running")
        return Path(f"/proc/{self.anchor.pid}/root") / str(inside).lstrip("/")

    def pids(self) -> set[int]:
        """Every live process in this host's network namespace (the anchor included)."""
        return netns_reaper.pids_in(netns_reaper.netns_id(self.netns))

    def listeners(self) -> list[Listener]:
        """What listens in this host's network namespace: TCP sockets in LISTEN, unconnected
        UDP sockets; with the processes holding them."""
        if self.anchor is None:
            raise HostError(f"host {self.label} is not running")
        owners: dict[int, list[int]] = {}
        for pid in sorted(self.pids()):
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        owners.setdefault(int(link[8:-1]), []).append(pid)
            except OSError:  # exited meanwhile
                continue
        found = []
        for proto in ("tcp", "tcp6", "udp", "udp6"):
            try:  # /proc/PID/net: the network namespace of PID, here the host's
                lines = Path(f"/proc/{self.anchor.pid}/net/{proto}").read_text().splitlines()
            except OSError:
                continue
            for line in lines[1:]:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
                listening = state == "0A" if proto.startswith("tcp") else \
                    int(remote.split(":")[1], 16) == 0
                if not listening:
                    continue
                hex_ip, hex_port = local.split(":")
                pids = tuple(sorted(set(owners.get(inode, ()))))
                found.append(Listener(proto, _proc_ip(hex_ip), int(hex_port, 16), pids,
                                      tuple(_comm(pid) for pid in pids)))
        return found

    # ---- life ------------------------------------------------------------------------------
    def _start_anchor(self, tmp_size: str | None, timeout: float) -> None:
        options = "mode=1777" + (f",size={tmp_size}" if tmp_size else "")
        code = _code_under_tmp()
        # the outside /tmp kept at /mnt (in this namespace only) while the tmpfs covers /tmp,
        # to bind the code back from
        keep = "mount --bind /tmp /mnt && " if code else ""
        restore = "".join(f"mkdir -p {shlex.quote(p)} && mount --bind "
                          f"{shlex.quote('/mnt' + p[len('/tmp'):])} {shlex.quote(p)} && "
                          for p in code) + ("umount /mnt && " if code else "")
        # every mount is in this anchor's own namespace, which no other fixture sees; the
        # tmpfs is named after the host's netns, so its mountinfo line says whose it is
        script = (f"{keep}mount -t tmpfs -o {options} {self.netns} /tmp && "
                  f"{restore}mkdir -p {self.home} {self.workdir} && "
                  # this private copy of the mount table holds every netns bound under
                  # /run/netns when it was made (other sessions' too): dropped, so that none
                  # is kept alive by this host after its `ip netns del`
                  f"{{ ! mountpoint -q {netns_reaper.NETNS_DIR} || "
                  f"umount --recursive --lazy {netns_reaper.NETNS_DIR}; }} && echo ready && "
                  "exec sleep infinity </dev/null >/dev/null 2>&1")
        # nsenter, unshare and sh each exec the next: the anchor's PID is the sleep's
        self.anchor = subprocess.Popen(
            ["nsenter", f"--net={netns_reaper.NETNS_DIR}/{self.netns}", "--", "unshare",
             "--mount", "--propagation", "private", "--", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        line = _read_line(self.anchor.stdout, timeout)
        if line != b"ready\n":
            self.anchor.kill()
            _, err = self.anchor.communicate(timeout=30)
            raise HostError(f"host {self.label}'s anchor did not start: "
                            f"{(line + err).decode(errors='replace').strip()}")
        self.anchor.stdout.close()
        self.anchor.stderr.close()
        own_mnt = os.stat("/proc/self/ns/mnt").st_ino
        if os.stat(f"/proc/{self.anchor.pid}/ns/mnt").st_ino == own_mnt:
            raise HostError(f"host {self.label}'s anchor shares the test's mount namespace")

    def _unmount(self) -> str | None:
        """Unmount the host's /tmp (once nothing but the anchor is left); the problem, if any.
        (The mount namespace, and the tmpfs with it, would go with the anchor anyway.)"""
        if self.anchor is None or self.anchor.poll() is not None:
            return None
        # "target is busy" for a moment after the last process has left the namespace: the
        # kernel closes an exiting process's files after it has left its namespaces (its last
        # fput runs as task work, after exit_task_namespaces); so tried again, for a while
        deadline = time.monotonic() + UNMOUNT_WAIT_S
        while True:
            done = subprocess.run(["nsenter", f"--mount=/proc/{self.anchor.pid}/ns/mnt", "--",
                                   "umount", "--recursive", "/tmp"], capture_output=True,
                                  text=True, timeout=60)  # with the code bound back under it
            if done.returncode == 0:
                return None
            if "busy" not in done.stderr or time.monotonic() > deadline:
                return f"umount of host {self.label}'s /tmp: {done.stderr.strip()}"
            time.sleep(0.2)

    def _reap_started(self) -> None:
        for process in [self.anchor, *self._started]:
            if process is None:
                continue
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # kept by kill_all's report
                pass


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "(exited)"


def _read_line(stream, timeout: float) -> bytes:
    """One line from a pipe, or what came before EOF or `timeout`."""
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                break
            chunk = os.read(stream.fileno(), 1)
            if not chunk:
                break
            data += chunk
    return data


# --------------------------------------------------------------------------- the two hosts

class TwoHosts:
    """Hosts A and B joined by one veth pair (A = .1, B = .2 of a private /24 that no other
    fixture on the machine holds: `subnets.py`). A context manager; `close()` (idempotent)
    ends everything and raises if something is left."""

    def __init__(self, *, tmp_size: str | None = None, timeout: float = 120.0) -> None:
        self.tmp_size, self.timeout = tmp_size, timeout
        self.id = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.netns = (f"eddy-mn-{self.id}-a", f"eddy-mn-{self.id}-b")
        self.shared_dir: Path | None = None
        self.hosts: list[Host] = []
        self._watchdog: subprocess.Popen | None = None
        self._made: list[str] = []  # the namespaces made so far
        self.subnet: ipaddress.IPv4Network | None = None
        self._subnet_claim: socket.socket | None = None  # holds `subnet` (subnets.py)
        self._closed = False

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    def __getitem__(self, label: str) -> Host:
        for host in self.hosts:
            if host.label == label:
                return host
        raise KeyError(label)

    def __enter__(self) -> TwoHosts:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> TwoHosts:
        reason = probe()
        if reason is not None:
            raise HostError(f"namespaces are not available here: {reason}")
        try:
            self._start()
        except BaseException:
            try:
                self.close()
            except HostError:
                pass  # the error that stopped the start matters more
            raise
        return self

    def _start(self) -> None:
        self.shared_dir = Path(tempfile.mkdtemp(prefix=f"eddy-multinode-{self.id}-",
                                                dir=SHARED_ROOT))  # 0700
        # a subnet no other fixture on the machine holds (another copy of the suite may be
        # running), held by the watchdog too: until it has deleted the namespaces using it
        subnet, self._subnet_claim = subnets.claim_free_subnet()
        self.subnet = subnet
        # the watchdog first: from here on nothing made can outlive the test process
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", str(REAPER), *self.netns, "--rmtree", str(self.shared_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, pass_fds=(self._subnet_claim.fileno(),))
        addresses = [str(subnet.network_address + 1), str(subnet.network_address + 2)]
        for name in self.netns:
            _ip("netns", "add", name)
            self._made.append(name)
        # made straight inside the namespaces: the veth never exists on the machine itself
        _ip("link", "add", "veth0", "netns", self.netns[0], "type", "veth", "peer", "name",
            "veth0", "netns", self.netns[1])
        for label, name, address in zip("AB", self.netns, addresses):
            _ip("-n", name, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "veth0")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", "veth0", "up")
            self.hosts.append(Host(label, name, address, subnet.prefixlen, self.shared_dir))
        for host in self.hosts:
            host._start_anchor(self.tmp_size, self.timeout)
        self._check_link()

    def _check_link(self) -> None:
        """A TCP connection from B to A over the veth (ping is not installed), retried while
        the link comes up."""
        server = self.a.popen(
            [sys.executable, "-I", "-c", textwrap.dedent(f"""
                import socket
                s = socket.socket()
                s.bind(({self.a.address!r}, 0))
                s.listen(1)
                print(s.getsockname()[1], flush=True)
                c, _ = s.accept()
                c.sendall(c.recv(64)[::-1])
                """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            port = _read_line(server.stdout, self.timeout).strip().decode()
            if not port.isdigit():
                server.kill()
                raise HostError(f"no listener on host A: {server.communicate()[1].decode()}")
            self.b.python(f"""
                import socket, time
                deadline = time.monotonic() + {self.timeout}
                while True:
                    try:
                        c = socket.create_connection(({self.a.address!r}, {port}), timeout=10)
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)
                c.sendall(b"eddy")
                assert c.recv(64) == b"ydde"
                """, timeout=self.timeout * 2)
        finally:  # it ends once B has connected; else it waits for no one
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            server.stdout.close()
            server.stderr.close()

    def stop_processes(self, host: Host | None = None) -> set[int]:
        """Kill every process of `host` (default: both) but the anchors; returns survivors."""
        hosts = [host] if host is not None else self.hosts
        anchors = frozenset(h.anchor.pid for h in self.hosts if h.anchor is not None)
        left = netns_reaper.kill_all([netns_reaper.netns_id(h.netns) for h in hosts],
                                     keep=anchors)
        for h in hosts:
            h._started = [p for p in h._started if p.poll() is None]  # reaped, where ours
        return left

    def leftovers(self) -> list[str]:
        """What of these hosts still exists (empty after `close`)."""
        left = []
        for name in self.netns:
            ns = netns_reaper.netns_id(name)
            if ns is not None:
                left.append(f"netns {name}")
            left += [f"pid {pid} ({_comm(pid)}) in netns {name}"
                     for pid in sorted(netns_reaper.pids_in(ns))]
        if self.shared_dir is not None and self.shared_dir.exists():
            left.append(f"directory {self.shared_dir}")
        for host in self.hosts:
            if host.anchor is not None and host.anchor.poll() is None:
                left.append(f"host {host.label}'s anchor (pid {host.anchor.pid})")
        return left

    def close(self) -> None:
        """Kill every process in both hosts (by PID, found by network namespace), unmount
        their /tmp, delete the namespaces (and so the veth) and the shared directory."""
        if self._closed:
            return
        self._closed = True
        problems = [f"pid {pid} ({_comm(pid)}) survived" for pid in sorted(self.stop_processes())]
        for host in self.hosts:
            problem = host._unmount()
            if problem:
                problems.append(problem)
        problems += netns_reaper.reap(self._made)
        for host in self.hosts:
            host._reap_started()
        if self._subnet_claim is not None:
            self._subnet_claim.close()  # the watchdog's copy goes when it exits
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir, ignore_errors=True)
        if self._watchdog is not None:
            self._watchdog.stdin.close()  # EOF: it finds nothing left, and exits
            try:
                self._watchdog.wait(timeout=120)
            except subprocess.TimeoutExpired:
                problems.append(f"the watchdog (pid {self._watchdog.pid}) did not exit")
        problems += self.leftovers()
        if problems:
            raise HostError("two-host teardown left things behind:\n  " + "\n  ".join(problems))


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise HostError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


# ------------------------------------------------------------------------ a Ray cluster

class RayCluster:
    """A Ray head on host A and a worker node on host B, token authentication on.

    num_cpus: per host label ({"A": 1, "B": 1} by default). resources: extra custom resources
    per host label, e.g. {"B": {"only_b": 1}}. Each host also gets `host_a` / `host_b` (100 of
    it, unless host_resources=False), so that `.options(resources={"host_b": 1})` places an
    actor on B. node_env: extra environment per host label for its Ray node, which its raylet
    passes to every worker it starts (e.g. {"B": {"EDDY_FAULT_POINTS": ...}}: a fault on B's
    workers only; a driver's environment does not reach another node's workers). `start()`
    returns once both nodes are alive; `stop()` (or the hosts' close) kills them.
    """

    def __init__(self, hosts: TwoHosts, *, num_cpus: dict[str, float] | None = None,
                 resources: dict[str, dict[str, float]] | None = None, port: int = 6379,
                 object_store_memory: int = 100 * 1024 * 1024, host_resources: bool = True,
                 node_env: dict[str, dict[str, str]] | None = None,
                 timeout: float = START_TIMEOUT_S) -> None:
        self.hosts, self.port, self.timeout = hosts, port, timeout
        self.node_env = node_env or {}
        self.num_cpus = {"A": 1, "B": 1, **(num_cpus or {})}
        self.resources: dict[str, dict[str, float]] = {}
        for host in hosts.hosts:
            own = {f"host_{host.label.lower()}": 100} if host_resources else {}
            self.resources[host.label] = {**own, **(resources or {}).get(host.label, {})}
        self.object_store_memory = object_store_memory
        self.head = hosts.a
        self.address = f"{self.head.address}:{port}"
        self.token_path = hosts.shared_dir / "ray" / "auth_token"
        self.log_dir = hosts.shared_dir / "logs"
        self.startup_s: dict[str, float] = {}  # measured: head, worker, nodes alive

    def env(self, extra: dict[str, str | None] | None = None) -> dict[str, str | None]:
        """What every Ray process of the cluster, and its drivers, get (on top of a host's)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
                "RAY_worker_niceness": "0", "RAY_USAGE_STATS_ENABLED": "0",
                "MULTINODE_RAY_ADDRESS": self.address, **(extra or {})}

    def _write_token(self) -> None:
        self.token_path.parent.mkdir(mode=0o700)
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(32))  # 256 bits, as ray/session.py's private_token

    def _ray_start(self, host: Host, args: list[str], timeout: float) -> None:
        self.log_dir.mkdir(mode=0o700, exist_ok=True)
        log = self.log_dir / f"ray-start-{host.label}.log"
        argv = [str(RAY), "start", f"--node-ip-address={host.address}",
                f"--num-cpus={self.num_cpus[host.label]}",
                f"--resources={json.dumps(self.resources[host.label])}",
                f"--object-store-memory={self.object_store_memory}",
                "--disable-usage-stats", "--log-style=record",
                "--log-color=false", *args]
        with open(log, "w") as out:  # a file, not a pipe: Ray's daemons may inherit it
            process = host.popen(argv, env=self.env(self.node_env.get(host.label)), stdout=out,
                                 stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
        if code != 0:
            raise HostError(f"`ray start` on host {host.label} "
                            f"{'timed out' if code is None else f'exited with {code}'}:\n"
                            f"{log.read_text()[-4000:]}\n{self.ray_logs(host)}")

    def start(self) -> RayCluster:
        """Start the head, then the worker node; return once both are alive. Each attempt
        has `timeout` in all; a failed one is killed and started again, START_ATTEMPTS times
        in all, then HostError with Ray's logs. Why: `ray start` gives a node a fixed 30 s to
        register with the GCS (ray/_private/node.py, not configurable), and on a loaded 2-core
        machine the GCS's event loop was measured 41 s behind: the start failed, the cluster
        itself was fine."""
        self._write_token()
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_once()
            except HostError:
                self.hosts.stop_processes()  # what this attempt left, by PID, before the next
                if attempt == START_ATTEMPTS:
                    raise

    def _start_once(self) -> RayCluster:
        began = time.monotonic()

        def left() -> float:  # each step gets what is left, and never less than 30 s
            return max(30.0, began + self.timeout - time.monotonic())

        self._ray_start(self.head, ["--head", f"--port={self.port}", "--include-dashboard=false"],
                        left())
        self.startup_s["head"] = time.monotonic() - began
        for host in self.hosts.hosts[1:]:
            self._ray_start(host, [f"--address={self.address}"], left())
        self.startup_s["worker"] = time.monotonic() - began
        self.wait_nodes(len(self.hosts.hosts), left())
        self.startup_s["alive"] = time.monotonic() - began
        return self

    def wait_nodes(self, count: int, timeout: float | None = None) -> list[dict]:
        """Poll (from a driver on A) until `count` nodes are alive; their ray.nodes() rows."""
        timeout = timeout or self.timeout
        nodes = self.driver_json(f"""
            import json, os, time, ray
            ray.init(address=os.environ["MULTINODE_RAY_ADDRESS"], logging_level="WARNING",
                     log_to_driver=False)
            deadline = time.monotonic() + {timeout}
            while True:
                alive = [n for n in ray.nodes() if n["Alive"]]
                if len(alive) >= {count} or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            print({JSON_MARK!r} + json.dumps([{{k: n[k] for k in ("NodeID",
                  "NodeManagerAddress", "Resources", "Alive")}} for n in alive]))
            """, timeout=timeout + 60)
        if len(nodes) < count:
            raise HostError(f"{len(nodes)} of {count} Ray nodes alive after {timeout} s: "
                            f"{nodes}\n{self.ray_logs(self.head)}")
        return nodes

    def driver(self, code: str, *, host: Host | None = None, timeout: float = 240.0,
               check: bool = True, env: dict[str, str | None] | None = None
               ) -> subprocess.CompletedProcess:
        """`python -c code` on host A (or `host`) with the cluster's token; the address is in
        $MULTINODE_RAY_ADDRESS (also `self.address`). HostCommandError if it fails."""
        host = host or self.head
        try:
            return host.python(code, env=self.env(env), timeout=timeout, check=check)
        except HostCommandError as error:
            raise HostCommandError(host.label, ["python", "-c", "..."], error.returncode,
                                   error.stdout, error.stderr + "\n" + self.ray_logs(host)
                                   ) from None

    def driver_json(self, code: str, **kwargs: Any) -> Any:
        """`driver`, and the JSON of its last line that starts with JSON_MARK."""
        done = self.driver(code, **kwargs)
        lines = [line for line in done.stdout.splitlines() if line.startswith(JSON_MARK)]
        if not lines:
            raise HostError(f"the driver printed no {JSON_MARK!r} line:\n{done.stdout[-3000:]}"
                            f"\n{done.stderr[-3000:]}")
        return json.loads(lines[-1][len(JSON_MARK):])

    def ray_logs(self, host: Host, tail: int = 1500) -> str:
        """The ends of the host's Ray error logs (for failure messages)."""
        try:  # an absolute link, to be read as the host sees it
            session = os.readlink(host.path("/tmp/ray/session_latest"))
        except (OSError, HostError):
            return f"(no Ray session on host {host.label})"
        logs = host.path(session) / "logs"
        parts = []
        for name in ("gcs_server.err", "gcs_server.out", "raylet.err", "raylet.out"):
            try:
                text = (logs / name).read_text(errors="replace")
            except OSError:
                continue
            if text.strip():
                parts.append(f"--- host {host.label} {name} (tail)\n{text[-tail:]}")
        return "\n".join(parts)

    def stop_node(self, host: Host) -> set[int]:
        """Kill every Ray process of `host` (its node ends as on a lost machine)."""
        return self.hosts.stop_processes(host)

    def stop(self) -> None:
        """Kill both nodes (the hosts stay up); remove the token."""
        left = self.hosts.stop_processes()
        shutil.rmtree(self.token_path.parent, ignore_errors=True)
        if left:
            raise HostError(f"Ray processes survived SIGKILL: {sorted(left)}")

"""The sandbox's child side: `python -I -S -B -u -X utf8 -c <stub> MODE ...`, started by
`eddyrl.envs.sandbox.runner` and nothing else.

It imports only the standard library. The runner sends this file's code object, marshalled,
ahead of the model's code on stdin (the stub execs it; compiling this file in every run would
cost more than starting the interpreter), or its source with -c when the child is another
interpreter. A setup failure is written to the status descriptor (`error: ...`, exit status
125); `ready` is written there just before the model's code runs.

MODE `namespaces`: three processes, all in the process group the runner made.

    launcher (host PID namespace)   unshare(mount, network, PID, IPC, UTS, cgroup; user too
      |                             when not root); build the root; pivot_root; wait; end
      |                             as the code ended (its exit status, or the same signal)
      +- init (PID 1 inside)        mount /proc, unmount the host's root, drop every
           |                        privilege; reap; report the code's wait status
           +- the code (PID 2)      rlimits, seccomp, the audit hook, then the model's code

The new root is a read-only tmpfs holding read-only bind mounts (nosuid, nodev) of the
standard library's directories and the shared-library directories (/lib*, /usr/lib*, and
those of the libraries the interpreter has loaded), /dev/{null,zero,full,random,urandom}, a
read-only /proc of the new PID namespace (process directories only: subset=pid), and the work
directory: a tmpfs of `workdir_bytes` (nosuid, nodev, noexec), so nothing the code writes
reaches the host's disk. The host's root is unmounted (pivot_root; a chroot on machines whose
pivot_root number is not listed here). The network namespace has a loopback device, down, and
nothing else; abstract Unix sockets are per network namespace. As root the code and the init
run as uid/gid 65534 (nobody) with empty capability sets (bounding set included); otherwise in
a user namespace that maps Eddy's user to itself, their capabilities dropped. Both have
no_new_privs and are not dumpable. The parent's process-group kill reaches the launcher and
the init; when the init dies the kernel kills everything left in the PID namespace, and the
launcher and the init die with their parent (PR_SET_PDEATHSIG).

MODE `none`: one process in the host's namespaces with the same rlimits, seccomp filter and
audit hook. Not a boundary.

The rlimits: RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE (from SandboxLimits), no core files,
RLIMIT_NOFILE 256, and RLIMIT_NPROC 0 (64 inside a PID namespace) where there is no seccomp
filter. The filter is seccomp.py's (its docstring lists what it refuses); the runner sends that
file's code ahead of this one's, which is where `install_seccomp` comes from. `ready` on the
status descriptor is followed by `; no seccomp filter: <why>` where the filter is missing, so
that the runner can say what is not isolated.
"""

import atexit
import linecache
import os
import resource
import signal
import sys
import traceback
import types

SETUP_FAILED = 125
MAX_FILES = 256  # RLIMIT_NOFILE: open files, pipes and sockets, each with kernel buffers
SANDBOX_ID = 65534  # nobody/nogroup: the uid and gid the code runs as when started by root
DEVICES = ("null", "zero", "full", "random", "urandom")
LIB_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64",
            "/usr/libx32")

# <linux/sched.h>, <linux/mount.h>, <linux/prctl.h>
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, \
    0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = \
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs's f_flag bit -> the mount flag a remount must keep (the kernel locks these)
KEPT_FLAGS = {os.ST_NOEXEC: MS_NOEXEC, os.ST_NODEV: MS_NODEV, os.ST_NOATIME: MS_NOATIME,
              os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
OLD_ROOT = "/.old-root"  # where the host's root is until the init has mounted /proc


# --------------------------------------------------------------------------------- syscalls

class _Libc:
    """The few libc calls the standard library lacks (Python 3.11 has no os.unshare), through
    ctypes, each raising OSError with the call's name."""

    def __init__(self):
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)

    def call(self, name, *args):
        result = getattr(self.lib, name)(*args)
        if result == -1:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{name}: {os.strerror(errno)}")
        return result

    def prctl(self, option, arg2=0, arg3=0):
        c = self.ctypes
        return self.call("prctl", c.c_int(option), c.c_ulong(arg2), c.c_ulong(arg3),
                         c.c_ulong(0), c.c_ulong(0))

    def mount(self, source, target, fstype, flags, data=None):
        c = self.ctypes
        encode = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
        try:
            self.call("mount", encode(source), encode(target), encode(fstype),
                      c.c_ulong(flags), encode(data))
        except OSError as exc:
            raise OSError(exc.errno, f"mount {source or ''} on {target}: "
                                     f"{os.strerror(exc.errno)}") from None

    def pivot_root(self, new, old):
        """pivot_root(2); where this machine's number for it is unknown, chroot (the code
        keeps no capability, so it cannot break out). Returns whether it pivoted."""
        number = SYS_PIVOT_ROOT.get(os.uname().machine)
        if number is None:
            os.chroot(new)
            return False
        self.call("syscall", self.ctypes.c_long(number), os.fsencode(new), os.fsencode(old))
        return True

    def drop_capabilities(self):
        for cap in range(64):  # the bounding set: needs CAP_SETPCAP, so before setuid
            try:
                self.prctl(PR_CAPBSET_DROP, cap)
            except OSError:
                break  # EINVAL past the last capability (EPERM without CAP_SETPCAP)
        try:
            self.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        except OSError:
            pass  # a kernel without ambient capabilities

    def clear_capabilities(self):
        c = self.ctypes
        header = (c.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (c.c_uint32 * 6)()  # effective, permitted, inheritable: x2, all zero
        self.call("capset", header, data)


# ------------------------------------------------------------------------- the audit hook

def install_hook(workdir, read_roots):
    """Defence in depth, not the boundary (ctypes, a C extension or a closure's cell gets
    round it): refuse sockets, processes, ctypes, signals to other processes, rlimit changes,
    writes outside `workdir` and reads outside it and `read_roots`. Paths relative to a
    `dir_fd` are resolved through /proc/self/fd (refused where that is not possible), and
    os.open, os.mkfifo and os.mknod, which raise no audit event for their `dir_fd` or at all,
    are wrapped."""
    import posix
    import _posixsubprocess

    realpath, fsdecode, join, isabs, dirname, isdir = (
        os.path.realpath, os.fsdecode, os.path.join, os.path.isabs, os.path.dirname,
        os.path.isdir)
    readlink, sep, getpid, modules = os.readlink, os.sep, os.getpid, sys.modules
    workdir = realpath(workdir)
    roots = tuple(realpath(r) for r in read_roots if os.path.exists(r)) + (workdir,)
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    refused = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
               "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
               "ctypes.cdata", "ctypes.call_function", "sys.addaudithook",
               "resource.setrlimit", "resource.prlimit"}
    signalling = {F_SETOWN, F_SETOWN_EX, F_SETSIG, FIOSETOWN, SIOCSPGRP, FIOASYNC, TIOCSTI}
    sealed = {"posix", "_posixsubprocess", "nt"}  # re-imported, they would bring back the
                                                  # functions wrapped below
    # event -> (path index, its dir_fd index or None) for each path it changes
    changes = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
               "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
               "os.truncate": ((0, None),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
               "os.utime": ((0, 3),), "os.setxattr": ((0, None),),
               "os.removexattr": ((0, None),)}

    def located(path, dir_fd=None):
        """The real path `path` names (relative to `dir_fd` when given), or None."""
        path = fsdecode(path)
        if dir_fd is not None and not isabs(path):
            try:
                path = join(readlink(f"/proc/self/fd/{int(dir_fd)}"), path)
            except (OSError, ValueError, TypeError):
                return None
        return realpath(path)

    def under(real, bases):
        return real is not None and any(real == b or real.startswith(b.rstrip(sep) + sep)
                                        for b in bases)

    def inside(path, dir_fd=None):
        return isinstance(path, int) or under(located(path, dir_fd), (workdir,))

    def refuse(what, why):
        raise PermissionError(f"sandbox: {what} refused ({why})")

    def hook(event, args):
        if event.startswith("socket.") or event in refused:
            refuse(event, "no network, no processes")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            if any(c in (mode or "") for c in "wax+") or flags & writing:
                if not inside(path):
                    refuse(f"writing {path!r}", "outside the working directory")
            elif not under(located(path), roots):
                refuse(f"reading {path!r}", "outside the working directory")
            elif mode is None and not inside(path) and isdir(path):
                refuse(f"opening directory {path!r}", "outside the working directory")
        elif event in changes:
            for index, fd_index in changes[event]:
                dir_fd = args[fd_index] if fd_index is not None else None
                if not inside(args[index], dir_fd):
                    refuse(f"{event} {args[index]!r}", "outside the working directory")
        elif event == "os.symlink":
            source, target, dir_fd = args
            link = located(target, dir_fd)
            pointed = None if link is None else realpath(join(dirname(link), fsdecode(source)))
            if not under(link, (workdir,)) or not under(pointed, (workdir,)):
                refuse(f"os.symlink {source!r} -> {target!r}", "outside the working directory")
        elif event in ("os.listdir", "os.scandir"):
            if args[0] is not None and not isinstance(args[0], int) and \
                    not under(located(args[0]), roots):
                refuse(f"{event} {args[0]!r}", "outside the working directory")
        elif event == "os.chdir":
            if not inside(args[0]):
                refuse(f"os.chdir {args[0]!r}", "outside the working directory")
        elif event in ("os.kill", "os.killpg"):
            if args[0] != getpid():
                refuse(f"{event} {args[0]}", "it may signal only itself")
        elif event in ("fcntl.fcntl", "fcntl.ioctl"):  # SIGIO and its kin, sent to an owner
            if args[1] in signalling or (args[1] == F_SETFL and isinstance(args[2], int)
                                         and args[2] & O_ASYNC):
                refuse(f"{event} {args[1]:#x}", "it may signal only itself")
        elif event == "import" and args[0] in sealed and args[0] not in modules:
            refuse(f"import {args[0]}", "sealed module")

    real_open, real_mkfifo = posix.open, posix.mkfifo

    def open(path, flags, mode=0o777, *, dir_fd=None):  # noqa: A001 (os.open's name)
        if dir_fd is not None and not isinstance(path, int) and not isabs(fsdecode(path)):
            absolute = located(path, dir_fd)
            if absolute is None:
                refuse(f"os.open {path!r} with dir_fd", "cannot tell where it points")
            return real_open(absolute, flags, mode)
        return real_open(path, flags, mode)

    def mkfifo(path, mode=0o666, *, dir_fd=None):
        if not inside(path, dir_fd):
            refuse(f"os.mkfifo {path!r}", "outside the working directory")
        return real_mkfifo(path, mode, dir_fd=dir_fd)

    def mknod(path, *args, **kwargs):
        refuse(f"os.mknod {path!r}", "no device nodes")

    def fork_exec(*args, **kwargs):
        refuse("_posixsubprocess.fork_exec", "no processes")

    for module in (os, posix):
        module.open, module.mkfifo, module.mknod = open, mkfifo, mknod
    _posixsubprocess.fork_exec = fork_exec
    sys.addaudithook(hook)


# --------------------------------------------------------------------------- the code

def run_code(status_fd, memory, cpu, fsize, layers, workdir, read_roots, libc, seccomp_why):
    """The process that runs the model's code (PID 2 in namespaces mode). Never returns."""
    try:
        os.chdir(workdir)
        source = sys.stdin.read()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # for the code, stdin is empty
        os.close(devnull)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        files = min(MAX_FILES, hard) if hard != resource.RLIM_INFINITY else MAX_FILES
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE: OSError
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if "seccomp" not in layers:
            seccomp_why = "turned off"
        elif libc is None:
            seccomp_why = seccomp_why or f"no seccomp on {sys.platform}"
        elif seccomp_why is None:
            seccomp_why = install_seccomp(libc, os.getpid())
        if libc is not None:
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
        if seccomp_why is not None:  # no filter: rlimit processes
            nproc = 0 if "namespaces" not in layers else 64  # inside a PID namespace, fork
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))  # is contained anyway
        for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.",
                                                                               "_ctypes"))]:
            del sys.modules[name]  # imported again, ctypes must dlopen (the hook refuses)
        libc = None
        if "hook" in layers:
            install_hook(workdir, read_roots)
        unfiltered = "" if seccomp_why in (None, "turned off") else \
            f"; no seccomp filter: {seccomp_why}"
        os.write(status_fd, f"ready{unfiltered}\n".encode("utf-8", "replace"))
        os.closerange(3, 1 << 16)
    except BaseException as exc:  # noqa: BLE001 (any failure of the setup is reported)
        setup_failed(status_fd, "preparing the interpreter", exc)
    main = types.ModuleType("__main__")
    sys.modules["__main__"], sys.argv = main, ["<tool>"]
    linecache.cache["<tool>"] = (len(source), None, source.splitlines(True), "<tool>")
    try:
        exec(compile(source, "<tool>", "exec"), main.__dict__)
    except SystemExit as exc:
        finish(exc.code)
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        finish(1)
    finish(0)


def finish(code):
    """End as the interpreter would (threads joined, atexit run, the exit code of SystemExit),
    but without the interpreter's teardown, which takes longer than the rest of a short run."""
    threading = sys.modules.get("threading")
    try:
        if threading is not None:
            threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException as exc:  # noqa: BLE001
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 (a closed or replaced stream)
            pass
    os._exit(code & 0xFF)


def setup_failed(status_fd, what, exc):
    try:
        os.write(status_fd, f"error: {what}: {exc}\n".encode("utf-8", "replace"))
    finally:
        os._exit(SETUP_FAILED)


# ---------------------------------------------------------------------- namespaces mode

def read_roots():
    """What the code may read besides its work directory: the standard library."""
    return [p for p in sys.path if p and os.path.isdir(p)] + \
        [f"/dev/{d}" for d in DEVICES] + ["/proc/self"]


def build_root(libc, root, workdir, workdir_bytes, owner):
    """Mount the new root at `root` (an empty directory) in this (new) mount namespace and
    pivot into it; the old root stays at OLD_ROOT until `detach_old_root`. Returns whether it
    pivoted (else it is a chroot)."""
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    libc.mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")

    def expose(path, depth=0):
        """Make `path` resolve in the new root as on the host (mirroring each symlink on the
        way); returns the symlink-free path to bind."""
        if depth > 40:
            raise OSError(40, f"too many symbolic links: {path}")
        current = "/"
        for part in path.split("/"):
            if part in ("", "."):
                continue
            current = os.path.dirname(current) if part == ".." else \
                os.path.join(current, part)
            if os.path.islink(current):
                target, mirror = os.readlink(current), root + current
                if not os.path.lexists(mirror):
                    os.makedirs(os.path.dirname(mirror), exist_ok=True)
                    os.symlink(target, mirror)
                current = expose(os.path.join(os.path.dirname(current), target), depth + 1)
        return current

    wanted = set()
    for path in [p for p in sys.path if p] + list(LIB_DIRS) + loaded_library_dirs():
        if os.path.lexists(path):
            real = expose(path)
            if os.path.exists(real):
                wanted.add(real)  # a directory, or a file (a zipped standard library)
    binds = [p for p in sorted(wanted)
             if not any(p.startswith(q.rstrip("/") + "/") for q in wanted if q != p)]
    for path in binds:
        bind(libc, path, root + path, MS_RDONLY)
    for name in DEVICES:
        source = f"/dev/{name}"
        if os.path.exists(source):
            bind(libc, source, root + source, MS_NOEXEC, keep_dev=True)
    os.makedirs(root + "/proc")
    os.mkdir(root + OLD_ROOT, 0)
    os.makedirs(root + workdir)
    libc.mount("tmpfs", root + workdir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size={workdir_bytes},nr_inodes={max(1024, workdir_bytes // 4096)},mode=700,"
               f"uid={owner[0]},gid={owner[1]}")
    libc.mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    pivoted = libc.pivot_root(".", OLD_ROOT[1:])
    os.chdir("/")
    return pivoted


def detach_old_root(libc):
    """Unmount the host's file system from the new root. Left until the init has mounted its
    /proc: in a user namespace the kernel allows a new proc only where one is visible."""
    libc.call("umount2", os.fsencode(OLD_ROOT), MNT_DETACH)


def loaded_library_dirs():
    """The directories of the shared objects this interpreter has mapped (libpython, libc)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/") and ".so" in fields[5]:
                found.add(os.path.dirname(fields[5].strip()))
    return sorted(found)


def bind(libc, source, target, extra, keep_dev=False):
    """Bind-mount `source` on `target`, then remount it nosuid (and nodev unless `keep_dev`)
    with `extra` flags, keeping the flags the kernel locks (noexec, the atime ones)."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w"):
            pass
    libc.mount(source, target, None, MS_BIND)
    present = os.statvfs(source).f_flag
    kept = sum(flag for bit, flag in KEPT_FLAGS.items() if present & bit)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | extra | kept | (0 if keep_dev else MS_NODEV)
    libc.mount(None, target, None, flags)


def namespaces(status_fd, parent_pid, memory, cpu, fsize, layers, workdir, root,
               workdir_bytes):
    libc = None
    try:
        libc = _Libc()
        watch_parent(libc, parent_pid)
        uid, gid = os.geteuid(), os.getegid()
        flags = (CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
                 | CLONE_NEWCGROUP)
        if uid != 0 or "userns" in layers:  # not root: a user namespace mapping this user
            layers.add("userns")              # to itself
            libc.call("unshare", flags | CLONE_NEWUSER)
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        else:
            libc.call("unshare", flags)
        libc.call("sethostname", b"sandbox", 7)
        roots = read_roots()
        owner = (uid, gid) if "userns" in layers else (SANDBOX_ID, SANDBOX_ID)
        pivoted = build_root(libc, root, workdir, int(workdir_bytes), owner)
    except BaseException as exc:  # noqa: BLE001
        setup_failed(status_fd, "isolating the interpreter", exc)
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        init(libc, status_fd, report_w, memory, cpu, fsize, layers, workdir, roots, pivoted)
    os.close(report_w)
    os.close(status_fd)
    relay(pid, report_r)


def init(libc, status_fd, report_w, memory, cpu, fsize, layers, workdir, roots, pivoted):
    """PID 1 of the new PID namespace: when it ends, the kernel kills whatever is left in it."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher killed: so is everything
        try:
            libc.mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                       "subset=pid")
        except OSError:  # an older kernel without subset=pid: no /proc, dir_fd is refused
            pass
        if pivoted:
            detach_old_root(libc)
        libc.drop_capabilities()
        if "userns" not in layers:  # root: become nobody, which drops every capability
            os.setgroups([])
            os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
            os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        libc.clear_capabilities()
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
        libc.prctl(PR_SET_DUMPABLE, 0)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # for PID 1: ignored when sent from inside
    except BaseException as exc:  # noqa: BLE001
        setup_failed(status_fd, "dropping privileges", exc)
    pid = os.fork()
    if pid == 0:
        os.close(report_w)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        run_code(status_fd, memory, cpu, fsize, layers, workdir, roots, libc, None)
    os.close(status_fd)
    status = None
    while status is None:
        try:
            reaped, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if reaped == pid:
            status = wait_status
    if status is not None:
        os.write(report_w, str(status).encode())
    os._exit(0)


def relay(pid, report_r):
    """Wait for the init; end as the code ended: its exit status or the signal that killed it
    (the CPU limit's SIGXCPU, an RLIMIT_AS SIGKILL...)."""
    _, status = os.waitpid(pid, 0)
    report = os.read(report_r, 64)
    if report:
        status = int(report)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    die_of(os.WTERMSIG(status) if os.WIFSIGNALED(status) else signal.SIGKILL)


def die_of(sig):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):
        pass  # SIGKILL and SIGSTOP keep their default
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def watch_parent(libc, parent_pid):
    """Die with the process that started this one (the driver)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(SETUP_FAILED)  # it is already gone


# --------------------------------------------------------------------------------- main

def main(argv):
    mode, status_fd, parent_pid, memory, cpu, fsize, layers, workdir = argv[:8]
    status_fd, parent_pid, memory, cpu, fsize = map(int, (status_fd, parent_pid, memory, cpu,
                                                          fsize))
    layers = set(layers.split(","))
    if mode == "namespaces":
        layers.add("namespaces")
        namespaces(status_fd, parent_pid, memory, cpu, fsize, layers, workdir, *argv[8:10])
    libc, why = None, None
    if sys.platform == "linux":
        try:
            libc = _Libc()
            watch_parent(libc, parent_pid)
        except OSError as exc:
            libc, why = None, f"no prctl: {exc}"
    run_code(status_fd, memory, cpu, fsize, layers, workdir, read_roots(), libc, why)


if __name__ == "__main__":
    main(sys.argv[1:])

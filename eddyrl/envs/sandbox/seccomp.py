"""The sandbox's seccomp filter: a deny list of system calls, as classic BPF, installed in the
child by `install_seccomp` just before the model's code runs.

Standard library only: the runner puts this file's code ahead of child.py's in the one script
the bare child interpreter runs (it imports nothing of Eddy's); tests import it as a module.

What fails with EPERM (x86_64 and aarch64; elsewhere there is no filter and the runner warns):
fork, vfork, clone without CLONE_THREAD or with a namespace flag (clone3 with ENOSYS, so that
threads fall back to clone), execve(at), ptrace, process_vm_*, kcmp, every mount, namespace
and chroot call, setrlimit and prlimit64 with a new limit, bpf, perf_event_open, userfaultfd,
io_uring, the key calls, kexec and module loading, reboot, swap, acct, quotactl,
open_by_handle_at, iopl/ioperm, syslog, memfd_create, shmget and msgget (memory outside
RLIMIT_AS and the work directory's size), mknod of anything but a FIFO, sockets of any family
but AF_UNIX, and every way to signal another process: kill and tgkill to any process but
itself; tkill, rt_(tg)sigqueueinfo and pidfd_* entirely; fcntl F_SETOWN, F_SETOWN_EX and
F_SETSIG and setting O_ASYNC with F_SETFL (SIGIO, or any signal F_SETSIG picks, sent to an
fd's owner: the driver, or a terminal's foreground group); ioctl FIOSETOWN, SIOCSPGRP and
FIOASYNC (the same by ioctl) and TIOCSTI (typing into a terminal). System calls of another
architecture (i386, arm32) kill the process; x32 ones fail.
"""

import os
import struct

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
CLONE_THREAD = 0x10000
CLONE_NAMESPACES = 0x20000 | 0x2000000 | 0x4000000 | 0x8000000 | 0x10000000 | 0x20000000 \
    | 0x40000000  # NEWNS NEWCGROUP NEWUTS NEWIPC NEWUSER NEWPID NEWNET
F_SETFL, F_SETOWN, F_SETSIG, F_SETOWN_EX, O_ASYNC = 4, 8, 10, 15, 0o20000  # both arches
FIOSETOWN, SIOCSPGRP, FIOASYNC, TIOCSTI = 0x8901, 0x8902, 0x5452, 0x5412

# Failing with EPERM whatever their arguments (a name an architecture lacks is skipped).
DENIED = (
    "fork", "vfork", "execve", "execveat",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "process_madvise",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "setrlimit", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "add_key", "request_key", "keyctl",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "uselib", "personality", "modify_ldt",
    "_sysctl", "name_to_handle_at", "open_by_handle_at", "iopl", "ioperm", "syslog",
    "lookup_dcookie", "vhangup",
    "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal", "pidfd_open",
    "pidfd_getfd",
    "memfd_create", "shmget", "msgget")
# Allowed or refused by their arguments (the check_<name> blocks of `seccomp_program`).
CHECKED = ("clone", "socket", "socketpair", "kill", "tgkill", "mknod", "mknodat", "prlimit64",
           "fcntl", "ioctl")

# os.uname().machine -> its audit architecture, whether it has the x32 ABI to refuse, and its
# system call numbers (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: the generic
# include/uapi/asm-generic/unistd.h)
TABLES = {
    "x86_64": dict(arch=0xC000003E, x32=True, numbers=dict(
        fork=57, vfork=58, execve=59, execveat=322, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, kcmp=312, process_madvise=440, mount=165, umount2=166,
        pivot_root=155, chroot=161, unshare=272, setns=308, open_tree=428, move_mount=429,
        fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, setrlimit=160,
        bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425, io_uring_enter=426,
        io_uring_register=427, add_key=248, request_key=249, keyctl=250, kexec_load=246,
        kexec_file_load=320, init_module=175, finit_module=313, delete_module=176, reboot=169,
        swapon=167, swapoff=168, acct=163, quotactl=179, uselib=134, personality=135,
        modify_ldt=154, _sysctl=156, name_to_handle_at=303, open_by_handle_at=304, iopl=172,
        ioperm=173, syslog=103, lookup_dcookie=212, vhangup=153, tkill=200,
        rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, pidfd_send_signal=424, pidfd_open=434,
        pidfd_getfd=438, memfd_create=319, shmget=29, msgget=68,
        clone=56, clone3=435, socket=41, socketpair=53, kill=62, tgkill=234, mknod=133,
        mknodat=259, prlimit64=302, fcntl=72, ioctl=16)),
    "aarch64": dict(arch=0xC00000B7, x32=False, numbers=dict(
        execve=221, execveat=281, ptrace=117, process_vm_readv=270, process_vm_writev=271,
        kcmp=272, process_madvise=440, mount=40, umount2=39, pivot_root=41, chroot=51,
        unshare=97, setns=268, open_tree=428, move_mount=429, fsopen=430, fsconfig=431,
        fsmount=432, fspick=433, mount_setattr=442, setrlimit=164, bpf=280,
        perf_event_open=241, userfaultfd=282, io_uring_setup=425, io_uring_enter=426,
        io_uring_register=427, add_key=217, request_key=218, keyctl=219, kexec_load=104,
        kexec_file_load=294, init_module=105, finit_module=273, delete_module=106, reboot=142,
        swapon=224, swapoff=225, acct=89, quotactl=60, personality=92,
        name_to_handle_at=264, open_by_handle_at=265, syslog=116, lookup_dcookie=18,
        vhangup=58, tkill=130, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240,
        pidfd_send_signal=424, pidfd_open=434, pidfd_getfd=438, memfd_create=279, shmget=194,
        msgget=186,
        clone=220, clone3=435, socket=198, socketpair=199, kill=129, tgkill=131, mknodat=33,
        prlimit64=261, fcntl=25, ioctl=29)),
}


def unfiltered_reason(machine=None):
    """Why this machine gets no filter (None where it does): checked before any prctl."""
    machine = machine or os.uname().machine
    if machine not in TABLES:
        return f"no seccomp filter for the {machine} architecture (only for " \
               f"{', '.join(TABLES)})"
    return None


def seccomp_program(machine, own_pid):
    """The filter for `machine` as struct sock_filter bytes and their count: a tiny assembler
    with forward labels."""
    LD, JEQ, JGE, AND, RET = 0x20, 0x15, 0x35, 0x54, 0x06  # ld [k]; jeq/jge #k; and #k; ret #k
    ALLOW, ERRNO, KILL = 0x7FFF0000, 0x00050000, 0x80000000
    EPERM, ENOSYS = 1, 38
    ARG = lambda n: 16 + 8 * n  # noqa: E731 (low 32 bits of args[n], little-endian)
    table = TABLES[machine]
    numbers = table["numbers"]
    program = []  # (code, jt, jf, k) with jt/jf a label or None (the next instruction)

    def emit(code, k, jt=None, jf=None):
        program.append((code, jt, jf, k))

    def label(name):
        program.append(name)

    emit(LD, 4)  # arch
    emit(JEQ, table["arch"], None, "kill")
    emit(LD, 0)  # nr
    if table["x32"]:
        emit(JGE, 0x40000000, "deny", None)
    for name in DENIED:
        if name in numbers:
            emit(JEQ, numbers[name], "deny", None)
    emit(JEQ, numbers["clone3"], "enosys", None)
    for name in CHECKED:
        if name in numbers:
            emit(JEQ, numbers[name], f"check_{name}", None)
    emit(RET, ALLOW)
    label("check_clone")  # a thread, creating no namespace
    emit(LD, ARG(0))
    emit(AND, CLONE_THREAD | CLONE_NAMESPACES)
    emit(JEQ, CLONE_THREAD, "allow", "deny")
    label("check_socket")
    label("check_socketpair")
    emit(LD, ARG(0))
    emit(JEQ, 1, "allow", "deny")  # AF_UNIX
    label("check_kill")  # (pid, sig) and tgkill's (tgid, tid, sig): this process only
    label("check_tgkill")
    emit(LD, ARG(0))
    emit(JEQ, own_pid, "allow", "deny")
    label("check_mknod")
    emit(LD, ARG(1))
    emit(AND, 0o170000)
    emit(JEQ, 0o010000, "allow", "deny")  # S_IFIFO
    label("check_mknodat")
    emit(LD, ARG(2))
    emit(AND, 0o170000)
    emit(JEQ, 0o010000, "allow", "deny")
    label("check_prlimit64")  # reading a limit (new_limit NULL) only
    emit(LD, ARG(2))
    emit(JEQ, 0, None, "deny")
    emit(LD, ARG(2) + 4)
    emit(JEQ, 0, "allow", "deny")
    label("check_fcntl")  # no owner for SIGIO, no signal number for it, no O_ASYNC
    emit(LD, ARG(1))
    for command in (F_SETOWN, F_SETOWN_EX, F_SETSIG):
        emit(JEQ, command, "deny", None)
    emit(JEQ, F_SETFL, None, "allow")
    emit(LD, ARG(2))
    emit(AND, O_ASYNC)
    emit(JEQ, 0, "allow", "deny")
    label("check_ioctl")
    emit(LD, ARG(1))
    for command in (FIOSETOWN, SIOCSPGRP, FIOASYNC, TIOCSTI):
        emit(JEQ, command, "deny", None)
    label("allow")
    emit(RET, ALLOW)
    label("deny")
    emit(RET, ERRNO | EPERM)
    label("enosys")
    emit(RET, ERRNO | ENOSYS)
    label("kill")
    emit(RET, KILL)
    return _assemble(program)


def _assemble(program):
    where, index = {}, 0
    for item in program:
        if isinstance(item, str):
            where[item] = index
        else:
            index += 1
    out, index = [], 0
    for item in program:
        if isinstance(item, str):
            continue
        code, jt, jf, k = item
        offset = lambda target: 0 if target is None else where[target] - index - 1  # noqa
        if not (0 <= offset(jt) < 256 and 0 <= offset(jf) < 256):
            raise ValueError("seccomp program: jump out of range")
        out.append(struct.pack("=HBBI", code, offset(jt), offset(jf), k))
        index += 1
    return b"".join(out), len(out)


def install_seccomp(libc, own_pid):
    """PR_SET_NO_NEW_PRIVS and the filter (`libc`: child.py's `_Libc`); returns why there is
    no filter, or None."""
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
    machine = os.uname().machine
    why = unfiltered_reason(machine)
    if why is not None:
        return why
    c = libc.ctypes
    code, length = seccomp_program(machine, own_pid)
    buffer = c.create_string_buffer(code, len(code))

    class Program(c.Structure):
        _fields_ = [("len", c.c_ushort), ("filter", c.c_void_p)]

    program = Program(length, c.cast(buffer, c.c_void_p))
    try:
        libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, c.addressof(program))
    except OSError as exc:
        return f"seccomp refused: {exc.strerror}"
    return None

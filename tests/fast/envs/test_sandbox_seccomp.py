"""The sandbox's seccomp filter as data: it assembles for every architecture it knows (aarch64
included, which no test machine here may run), and its tables name each call once."""

import struct

import pytest

from eddyrl.envs.sandbox import seccomp


@pytest.mark.parametrize("machine", list(seccomp.TABLES))
def test_the_filter_assembles_for_each_architecture(machine):
    code, length = seccomp.seccomp_program(machine, own_pid=2)
    assert len(code) == 8 * length and 0 < length < 4096  # BPF_MAXINSNS
    first = struct.unpack("=HBBI", code[8:16])
    assert first[3] == seccomp.TABLES[machine]["arch"]  # the architecture is checked first


@pytest.mark.parametrize("machine", list(seccomp.TABLES))
def test_each_system_call_has_one_number(machine):
    numbers = seccomp.TABLES[machine]["numbers"]
    assert len(set(numbers.values())) == len(numbers), "two calls share a number"
    known = set(seccomp.DENIED) | set(seccomp.CHECKED) | {"clone3"}
    assert set(numbers) <= known, set(numbers) - known
    for name in ("kill", "tgkill", "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
                 "pidfd_send_signal", "fcntl", "ioctl", "clone", "execve"):
        assert name in numbers, f"{machine} lacks {name}: signals or processes would pass"


def test_an_unknown_architecture_says_it_has_no_filter():
    assert seccomp.unfiltered_reason("x86_64") is None
    assert "riscv64" in seccomp.unfiltered_reason("riscv64")


# A classic-BPF interpreter for the five instructions the assembler emits, so that the filter's
# decisions can be checked for every architecture on any machine.
ALLOW, EPERM, ENOSYS, KILL = "allow", "EPERM", "ENOSYS", "kill"


def decide(machine, call, *args, own_pid=2, arch=None):
    table = seccomp.TABLES[machine]
    nr = table["numbers"][call] if isinstance(call, str) else call
    data = struct.pack("=IIQ6Q", nr, table["arch"] if arch is None else arch, 0,
                       *(list(args) + [0] * (6 - len(args))))
    code, length = seccomp.seccomp_program(machine, own_pid)
    program = [struct.unpack("=HBBI", code[i * 8:i * 8 + 8]) for i in range(length)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = program[pc]
        if op == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
        elif op == 0x54:  # and #k
            acc &= k
        elif op in (0x15, 0x35):  # jeq, jge #k
            pc += jt if (acc == k if op == 0x15 else acc >= k) else jf
        elif op == 0x06:  # ret #k
            return {0x7FFF0000: ALLOW, 0x00050001: EPERM, 0x00050026: ENOSYS,
                    0x80000000: KILL}[k]
        else:
            raise AssertionError(f"unknown instruction {op:#x}")
        pc += 1


@pytest.mark.parametrize("machine", list(seccomp.TABLES))
def test_signals_reach_no_other_process(machine):
    """Issue 32, defect 4: SIGIO routed to the driver by fcntl killed it in isolation none."""
    assert decide(machine, "kill", 2, 9) == ALLOW  # itself
    assert decide(machine, "kill", 1, 9) == EPERM  # its parent
    assert decide(machine, "kill", 0, 9) == EPERM  # its process group
    assert decide(machine, "kill", (1 << 32) - 1, 9) == EPERM  # -1: everything it may signal
    assert decide(machine, "tgkill", 2, 3, 10) == ALLOW
    assert decide(machine, "tgkill", 1, 1, 10) == EPERM
    for call in ("tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal"):
        assert decide(machine, call, 2, 9) == EPERM
    for command in (seccomp.F_SETOWN, seccomp.F_SETOWN_EX, seccomp.F_SETSIG):
        assert decide(machine, "fcntl", 1, command, 1) == EPERM
    assert decide(machine, "fcntl", 1, seccomp.F_SETFL, seccomp.O_ASYNC | 0o4000) == EPERM
    assert decide(machine, "fcntl", 1, seccomp.F_SETFL, 0o4000) == ALLOW  # O_NONBLOCK
    assert decide(machine, "fcntl", 1, 3) == ALLOW  # F_GETFL
    for request in (seccomp.FIOSETOWN, seccomp.SIOCSPGRP, seccomp.FIOASYNC, seccomp.TIOCSTI):
        assert decide(machine, "ioctl", 1, request, 0) == EPERM
    assert decide(machine, "ioctl", 1, 0x5401, 0) == ALLOW  # TCGETS: isatty()


@pytest.mark.parametrize("machine", list(seccomp.TABLES))
def test_processes_and_other_architectures_are_refused(machine):
    assert decide(machine, "execve") == EPERM
    assert decide(machine, "clone", 0x11) == EPERM  # SIGCHLD: a fork
    assert decide(machine, "clone", 0x3D0F00) == ALLOW  # glibc's thread flags
    assert decide(machine, "clone", 0x3D0F00 | 0x10000000) == EPERM  # a thread in a new userns
    assert decide(machine, "clone3") == ENOSYS
    assert decide(machine, "socket", 2) == EPERM and decide(machine, "socket", 1) == ALLOW
    assert decide(machine, 63) == ALLOW  # read on aarch64, uname on x86_64
    assert decide(machine, 63, arch=0x40000003) == KILL  # i386 / another ABI

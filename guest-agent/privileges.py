"""What the agent's children may do, and the agent's own credentials: the sandbox
user for the kernel and commands, no new privileges by execve, the agent's
/proc entries hidden from them (``hidepid`` in a VM, a PID namespace of their
own under gVisor), no new namespaces for them, and per-thread credential
switches for the file API."""

from __future__ import annotations

import ctypes
import errno
import os
import struct

try:
    from .diagnostics import log
except ImportError:  # run as a script
    from diagnostics import log  # type: ignore


def as_user(uid: int | None) -> dict:
    """Child processes (the kernel, commands) run as the sandbox user: they
    can then neither read nor write the agent's own stream through
    /proc/1/fd, nor signal or trace the agent."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def no_new_privileges() -> None:
    """PR_SET_NO_NEW_PRIVS on the agent itself, so that every process it
    starts (the kernel, commands, whatever they start) inherits it: execve
    never grants more privileges, so setuid binaries inside (su, newgrp) do
    not elevate. Set here rather than in each child: a preexec function in a
    process with threads (zmq's) can deadlock, and this way no child can be
    started without it. Irreversible; the agent itself never needs to gain
    privileges by execve. gVisor's OCI noNewPrivileges and a VM's init
    (setpriv --no-new-privs) set it too; this holds wherever the agent runs."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        log(f"cannot set no_new_privs: {e}")


def hide_processes() -> None:
    """Remount /proc with hidepid=2, so that the kernel's user sees its own processes only: not the
    agent's (pid 1) environment, memory map, status or anything else under /proc/1. A VM's agent is root with every capability and this works; gVisor's Sentry has no
    hidepid and the agent there no CAP_SYS_ADMIN (EPERM, nothing to do: docs/security.md says what
    stays readable there)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC: nothing under /proc is to be executed either
        if libc.mount(b"proc", b"/proc", b"proc", 32 | 2 | 4 | 8, b"hidepid=2") != 0:
            err = ctypes.get_errno()
            if err != errno.EPERM:
                raise OSError(err, os.strerror(err))
    except (OSError, AttributeError) as e:
        log(f"cannot hide the agent's processes in /proc: {e}")


# Every CLONE_NEW* flag: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
# AUDIT_ARCH and the numbers of unshare, setns, clone, clone3.
SECCOMP_ARCH = {"x86_64": (0xC000003E, 272, 308, 56, 435), "aarch64": (0xC00000B7, 97, 268, 220, 435)}


def _check(r: int, what: str) -> None:
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def no_new_namespaces() -> None:
    """A seccomp filter on the calling process, inherited by everything it starts: unshare, setns and
    clone with any CLONE_NEW* flag fail with EPERM, clone3 (whose flags a filter cannot read) with
    ENOSYS, so that libc falls back to clone. Namespaces are kernel surface that nothing in a sandbox
    needs. The spawner installs it once it has its PID namespace. Irreversible; needs
    no_new_privileges first (or CAP_SYS_ADMIN)."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCH:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {machine}")
    arch, unshare, setns, clone, clone3 = SECCOMP_ARCH[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    prog = [  # a jump goes to the instruction after it plus its offset
        op(ld, 4),                          # 0: seccomp_data.arch
        op(jeq, arch, 1, 0),
        op(ret, enosys),                    # 2: another ABI: nothing of it is allowed
        op(ld, 0),                          # 3: seccomp_data.nr
        op(jge, 0x40000000, 8, 0),          # -> 13: x32's numbers, the same calls under another name
        op(jeq, unshare, 6, 0),             # -> 12
        op(jeq, setns, 5, 0),               # -> 12
        op(jeq, clone3, 5, 0),              # -> 13
        op(jeq, clone, 0, 2),               # -> 9, else 11
        op(ld, 16),                         # 9: clone's flags (args[0], low word)
        op(jset, CLONE_NEW_ANY, 1, 0),      # -> 12, else 11
        op(ret, allow),                     # 11
        op(ret, eperm),                     # 12
        op(ret, enosys),                    # 13
    ]
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "seccomp filter")  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


# setresuid, setresgid, setgroups: called directly, they change the calling
# thread's credentials only (see files.WorkspaceFiles.acting_as_user).
SYSCALLS = {"x86_64": (117, 119, 116), "aarch64": (147, 149, 159)}


class ThreadCredentials:
    """The calling thread's effective uid/gid and groups, by raw system call.
    glibc's set*id functions (which os.setresuid calls) apply a change to
    every thread of the process, by signalling each one; under gVisor's ptrace
    platform that cost about 10 ms per file operation."""

    def __init__(self):
        self.nr = SYSCALLS.get(os.uname().machine)
        self.libc = ctypes.CDLL(None, use_errno=True) if self.nr else None

    def _call(self, nr: int, *args) -> None:
        if self.libc.syscall(nr, *args) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    def setresuid(self, r: int, e: int, s: int) -> None:
        if not self.nr:
            return os.setresuid(r, e, s)
        self._call(self.nr[0], ctypes.c_long(r), ctypes.c_long(e), ctypes.c_long(s))

    def setresgid(self, r: int, e: int, s: int) -> None:
        if not self.nr:
            return os.setresgid(r, e, s)
        self._call(self.nr[1], ctypes.c_long(r), ctypes.c_long(e), ctypes.c_long(s))

    def setgroups(self, groups: list[int]) -> None:
        if not self.nr:
            return os.setgroups(groups)
        arr = (ctypes.c_uint * max(1, len(groups)))(*groups)
        self._call(self.nr[2], ctypes.c_long(len(groups)), arr)

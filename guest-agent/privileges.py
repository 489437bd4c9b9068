"""What the agent's children may do, and the agent's own credentials: the sandbox
user for the kernel and commands, no new privileges by execve, the agent's
/proc entries hidden where the guest allows it, and per-thread credential
switches for the file API."""

from __future__ import annotations

import ctypes
import errno
import os

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

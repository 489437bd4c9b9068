"""The guest agent's seccomp filter against new namespaces (``no_new_namespaces`` in
sandgate_agent/privileges.py), on this host's kernel, in a forked child: the filter
is irreversible and would bind the test process otherwise. Under gVisor the same
filter holds every process of a sandbox (tests/security/)."""

import ctypes
import errno
import json
import os
import threading

from sandgate_agent import privileges

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
SIGCHLD = 17


def in_child(fn) -> str:
    """``fn``'s answer (a short string), run in a forked child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, str(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_no_new_namespaces_refuses_unshare_setns_and_clone_flags_and_allows_the_rest():
    libc = ctypes.CDLL(None, use_errno=True)
    nr = privileges.SECCOMP_ARCH[os.uname().machine]

    def attempt():
        privileges.no_new_privileges()
        privileges.no_new_namespaces()
        got = {}
        for name, call in (("unshare_user", lambda: libc.unshare(CLONE_NEWUSER)),
                           ("unshare_ns", lambda: libc.unshare(CLONE_NEWNS)),
                           ("setns", lambda: libc.setns(0, 0)),
                           ("clone_newpid", lambda: libc.syscall(nr[3], CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0)),
                           ("clone_newnet", lambda: libc.syscall(nr[3], CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0)),
                           ("clone3", lambda: libc.syscall(nr[4], 0, 0))):
            r = call()
            got[name] = errno.errorcode.get(ctypes.get_errno(), "?") if r == -1 else f"ran:{r}"
        # What a sandbox does every day still works: a fork, a thread, an exec'd child.
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        got["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        got["thread"] = "ok"
        got["exec"] = os.system("exit 3") >> 8
        return got

    got = json.loads(in_child(lambda: json.dumps(attempt())))
    assert got == {"unshare_user": "EPERM", "unshare_ns": "EPERM", "setns": "EPERM", "clone_newpid": "EPERM",
                   "clone_newnet": "EPERM", "clone3": "ENOSYS", "fork": 7, "thread": "ok", "exec": 3}, got

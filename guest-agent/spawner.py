"""The process that starts the kernel and commands for the agent, in a PID namespace of their own.

Under gVisor a process's /proc files are readable by every user (no hidepid, no ptrace-access check),
so the kernel's user would read the agent's environment and memory map. The kernel and commands
therefore run in a PID namespace whose /proc does not have the agent. The agent cannot make it
itself: a process that has unshared CLONE_NEWPID can start no thread (EINVAL), and the agent runs
threads; and this runsc cannot setns into a PID namespace (EOPNOTSUPP). So the agent forks this
spawner before any thread starts: single-threaded, it unshares CLONE_NEWPID, forbids new namespaces
to itself and all it starts (``no_new_namespaces``), forks the namespace's init (which mounts a
/proc of the namespace and becomes a reaper), then starts processes on request. Requests and their
descriptors come over a socket pair; the pids (in the agent's numbering: the spawner is outside the
namespace, like the agent) and exit statuses go back, since the agent is not their parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import socket
import sys

try:
    from .diagnostics import log
    from .privileges import no_new_namespaces
except ImportError:  # run as a script
    from diagnostics import log  # type: ignore
    from privileges import no_new_namespaces  # type: ignore

CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MAX_FDS = 16
# The namespace's init: it only reaps what is reparented to it. A fresh program, not a fork of the
# agent, so that what its /proc/1 shows (environment, memory layout) is nothing of the agent's.
REAPER = """import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    signal.sigwaitinfo({signal.SIGCHLD})
"""


class Child:
    """A process the spawner started: what the agent needs of asyncio's Process."""

    def __init__(self, pid: int, exited: asyncio.Future):
        self.pid = pid
        self.exited = exited

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)


class Spawner:
    """The agent's end: ``fork`` before any thread, ``start`` in the event loop, then ``spawn``."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.ids = 0
        self.replies: dict[int, asyncio.Future] = {}
        self.exits: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Future | None = None

    @classmethod
    def fork(cls) -> "Spawner":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # only os._exit leaves this branch
            code = 1
            try:
                ours.close()
                code = serve(theirs)
            except BaseException as e:
                with contextlib.suppress(OSError):
                    theirs.send(f"{type(e).__name__}: {e}".encode())
            os._exit(code)
        theirs.close()
        said = ours.recv(1 << 12)  # its namespace made, or why not
        if said != b"ready":
            os.waitpid(pid, 0)
            raise OSError(errno.EPERM, said.decode(errors="replace") or "the spawner ended")
        ours.setblocking(False)
        return cls(ours, pid)

    def start(self) -> None:
        self.reader = asyncio.ensure_future(self._read())

    def _exit_of(self, pid: int) -> asyncio.Future:
        if pid not in self.exits:
            self.exits[pid] = asyncio.get_running_loop().create_future()
        return self.exits[pid]

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await loop.sock_recv(self.sock, 1 << 16)
            except OSError:
                data = b""
            if not data:
                log("the spawner is gone: no kernel or command can be started")
                for fut in self.replies.values():
                    if not fut.done():
                        fut.set_exception(RuntimeError("the spawner is gone"))
                return
            msg = json.loads(data)
            if "exit" in msg:
                fut = self._exit_of(msg["exit"])
                if not fut.done():
                    fut.set_result(msg["code"])
            else:
                fut = self.replies.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    if "error" in msg:  # as asyncio's would: FileNotFoundError and the like
                        fut.set_exception(OSError(msg["errno"] or errno.EIO, msg["error"], msg.get("filename")))
                    else:
                        fut.set_result(msg["pid"])

    async def spawn(self, argv: list[str], *, env: dict, fds: dict[int, int], cwd: str | None = None,
                    cwd_fd: int | None = None, user: int | None = None) -> Child:
        """Start ``argv`` in a new session with ``fds`` (its descriptor number -> ours) as its only
        descriptors, in ``cwd`` (or the directory ``cwd_fd``), as ``user``."""
        self.ids += 1
        targets, sent = list(fds), list(fds.values())
        if cwd_fd is not None:
            sent.append(cwd_fd)
        req = {"id": self.ids, "argv": argv, "env": env, "targets": targets, "cwd": cwd,
               "cwd_fd": cwd_fd is not None, "user": user}
        fut = self.replies[self.ids] = asyncio.get_running_loop().create_future()
        socket.send_fds(self.sock, [json.dumps(req).encode()], sent)
        pid = await fut
        return Child(pid, self._exit_of(pid))

    async def run(self, argv: list[str], *, cwd_fd: int, env: dict, user: int | None,
                  timeout: float) -> tuple[int, bool, bytes, bytes]:
        """A command to its end, as ``exec`` runs one: (exit code, timed out, stdout, stderr), its
        session killed at ``timeout``."""
        loop = asyncio.get_running_loop()
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        try:
            child = await self.spawn(argv, cwd_fd=cwd_fd, env=env, user=user, fds={0: null, 1: out_w, 2: err_w})
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)

        async def read_all(fd: int) -> bytes:
            reader = asyncio.StreamReader()
            transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                        os.fdopen(fd, "rb", 0))
            try:
                return await reader.read()
            finally:
                transport.close()

        done = asyncio.gather(read_all(out_r), read_all(err_r), child.wait())
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            os.killpg(child.pid, signal.SIGKILL)
        out, err, code = await done
        return code, timed_out, out, err


def serve(sock: socket.socket) -> int:
    """The spawner's loop, until the agent's end closes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWPID)")
    no_new_namespaces()
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)  # the agent's stream (stdio) is the agent's alone
    os.dup2(null, 1)
    os.close(null)
    init = _start_init(libc)
    sock.send(b"ready")
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            while os.read(wake_r, 512) == 512:
                pass
            if _reap(sock, init):
                return 1
        if sock in ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 16, MAX_FDS)
            except InterruptedError:
                continue
            if not data:
                return 0
            try:
                _start(sock, json.loads(data), fds)
            finally:
                for fd in fds:
                    os.close(fd)


def _start_init(libc) -> int:
    """The namespace's pid 1: mounts its /proc over the old one, then becomes ``REAPER``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
                raise OSError(ctypes.get_errno(), "mounting /proc")
            # No stdin or stdout: the sandbox user can open /proc/1/fd/N again by its path (a /dev/null,
            # say), and pid 1 is what the escape suite tries first.
            os.close(0)
            os.close(1)
            os.execve(sys.executable, [sys.executable, "-I", "-S", "-c", REAPER], {})
        except BaseException as e:
            os.write(w, f"{type(e).__name__}: {e}".encode())
        os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        failed = f.read()  # empty once the exec closed the pipe
    if failed:
        raise OSError(errno.EPERM, f"the PID namespace's init failed: {failed.decode(errors='replace')}")
    return pid


def _reap(sock: socket.socket, init: int) -> bool:
    """Tell the agent of every child that ended; True when the namespace's init did."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return False
        if pid == init:
            log("the PID namespace's init ended: nothing more can start in it")
            return True
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _start(sock: socket.socket, req: dict, fds: list[int]) -> None:
    err_r, err_w = os.pipe()  # close-on-exec: empty when the exec worked
    pid = os.fork()
    if pid == 0:
        try:
            os.close(err_r)
            _become(req, fds)
        except OSError as e:
            os.write(err_w, json.dumps({"errno": e.errno, "error": e.strerror, "filename": e.filename}).encode())
        except BaseException as e:
            os.write(err_w, json.dumps({"errno": errno.EIO, "error": f"{type(e).__name__}: {e}"}).encode())
        os._exit(127)
    os.close(err_w)
    with os.fdopen(err_r, "rb") as f:
        failed = f.read()
    if failed:
        os.waitpid(pid, 0)
        sock.send(json.dumps({"id": req["id"], **json.loads(failed)}).encode())
    else:
        sock.send(json.dumps({"id": req["id"], "pid": pid}).encode())


def _become(req: dict, fds: list[int]) -> None:
    """In the child: its session, descriptors, directory and user, then the program."""
    os.setsid()
    if req["cwd_fd"]:
        os.fchdir(fds[-1])
    elif req["cwd"]:
        os.chdir(req["cwd"])
    # Every descriptor it gets moved above the targets and itself first, so that no dup2 overwrites one
    # still to come.
    high = max([*req["targets"], *fds, 2]) + 1
    moved = [os.dup2(fd, high + i, inheritable=False) for i, fd in enumerate(fds)]
    for fd in fds:  # received inheritable: none may reach the program under its old number
        os.close(fd)
    for target, fd in zip(req["targets"], moved):
        os.dup2(fd, target)  # inheritable
    user = req["user"]
    if user is not None:
        os.setgroups([])
        os.setresgid(user, user, user)
        os.setresuid(user, user, user)
    os.closerange(high, high + len(moved))
    os.execvpe(req["argv"][0], req["argv"], req["env"])

"""Holds one runtime's stdio, so that the sandbox outlives a killed gateway.

    python shim.py SOCKET STATUS -- runsc ... run ...

The gateway starts a runtime whose agent speaks on stdin/stdout (runsc)
through this shim. The shim owns those pipes and offers the agent's stream on
the unix socket SOCKET to one gateway at a time (a new connection replaces
the old one). When the gateway process dies, nothing reaches the agent's
stdin: it runs on, and the next gateway process connects and adopts it
(Driver.adopt). Frames (u32 header length, u32 payload length, header,
payload; see sandgate_agent/protocol.py) are relayed so that every connection
starts and ends on a frame boundary: what a gateway sent is passed on only
once a frame is whole, a frame from the agent goes to the gateway that was
connected at its first byte (the rest of it is dropped if that gateway goes),
and a frame that starts while no gateway is connected waits for the next one.
When the runtime exits, its exit status (negative for a signal, as in
subprocess) goes to the file STATUS and the shim exits.

    python shim.py SOCKET STATUS --detached PIDFILE [--cgroup NAME] [--lease FILE SECONDS] [--cleanup CMD ...] -- runsc ... run --detach --pid-file PIDFILE ...

With --detached the runtime is a launcher that starts the sandbox, writes its
pid to PIDFILE and exits 0 (runsc --detach: no Go process per sandbox left
waiting on it, ~5 MiB each). The shim is the subreaper of what the launcher
started, so the sandbox becomes its child: its exit ends the shim, with its
status, as the launcher's would have. What an attached runsc did when its
sandbox ended, the shim does then: it waits a moment for the rest of what
the launcher started (the gofer) and kills what is left, all of it at once if
the launcher failed, so nothing outlives the shim; and it runs CMD (`runsc
delete --force ID`), so that runsc's record of the sandbox, which names its
pids, is gone before those pids can be reused. Then it removes the cgroups
NAME (``sandgate/ID``) in every hierarchy: runsc makes them before it has a
record of the sandbox, so a launcher stopped in between leaves them to no
`runsc delete`.

With --lease, a shim with no gateway connected ends its runtime (SIGKILL, then
the exit above) once SECONDS have passed both since a gateway was last
connected and since FILE's modification time, which a running gateway keeps
renewing (RuntimeLease in base.py): a gateway that stays down, whose sandboxes
other nodes of a fleet take over, leaves no second copy running for good.

Standard library only and run by path, not imported with the package: it
lives as long as its sandbox, one per sandbox, so it is one thread on
`selectors` with no asyncio or subprocess imported (4 MiB PSS, not 12).
"""

import os
import selectors
import signal
import socket
import struct
import sys
import time

PREFIX = struct.Struct(">II")
MAX_FRAME = (1 << 20) + (256 << 20) + PREFIX.size  # protocol.MAX_HEADER + MAX_PAYLOAD
CHUNK = 1 << 20
HIGH_WATER = 4 * CHUNK  # bytes queued toward one side before the other side is no longer read


class Shim:
    def __init__(self, listener: socket.socket, pid: int, stdin: int, stdout: int, wakeup: int,
                 pidfile: str = "", lease: tuple = (), cgroup: str = ""):
        self.sel = selectors.DefaultSelector()
        self.listener, self.pid, self.stdin, self.stdout, self.wakeup = listener, pid, stdin, stdout, wakeup
        self.pidfile = pidfile  # until the launcher has exited (--detached): where it names the sandbox
        self.exited = {}  # pid -> exit status of children reaped but not (yet) the runtime
        self.pidfd = None  # the sandbox's, only if it is not our child (watch_stranger)
        self.client = None  # the connected gateway's socket
        self.from_client = bytearray()  # what the gateway sent, not yet a whole frame
        self.to_agent = bytearray()  # whole frames for the agent's stdin
        self.from_agent = bytearray()  # the agent's output not yet given to a gateway
        self.to_client = bytearray()  # for the gateway's socket
        self.frame_left = 0  # bytes of the agent's current frame still to come
        self.frame_owner = None  # the gateway that frame goes to (None: dropped)
        self.agent_eof = False
        self.code = None
        self.lease = lease  # (file, seconds), or () for none
        self.cgroup = cgroup
        self.gateway_seen = time.time()  # the gateway that started us was there
        self.lease_ended = False
        for fd in (listener, stdin, stdout, wakeup):
            os.set_blocking(fd if isinstance(fd, int) else fd.fileno(), False)
        self.sel.register(listener, selectors.EVENT_READ)
        self.sel.register(wakeup, selectors.EVENT_READ)
        self.watched = {}  # fd or socket -> events, as registered now

    def watch(self, obj, events: int) -> None:
        """Register obj for events (0: unregister), touching the selector only on a change."""
        old = self.watched.get(obj, 0)
        if events == old:
            return
        if not events:
            self.sel.unregister(obj)
            del self.watched[obj]
        elif not old:
            self.sel.register(obj, events)
            self.watched[obj] = events
        else:
            self.sel.modify(obj, events)
            self.watched[obj] = events

    def update(self) -> None:
        """What to wait for, from the buffers: each side is read only while
        the other has room, so a slow reader holds the writer back."""
        c = self.client
        if c is not None:
            ev = selectors.EVENT_READ if len(self.to_agent) < HIGH_WATER else 0
            self.watch(c, ev | (selectors.EVENT_WRITE if self.to_client else 0))
        wants_agent = not self.agent_eof and len(self.from_agent) < HIGH_WATER and len(self.to_client) < HIGH_WATER \
            and (c is not None or self.frame_left)  # with no gateway, only to drop the rest of a frame
        self.watch(self.stdout, selectors.EVENT_READ if wants_agent else 0)
        self.watch(self.stdin, selectors.EVENT_WRITE if self.to_agent else 0)

    def run(self) -> int:
        check = min(max(self.lease[1] / 4, 0.5), 5.0) if self.lease else None
        while self.code is None:
            self.update()
            if self.lease and not self.lease_ended:
                self.check_lease()
            for key, ready in self.sel.select(check):
                obj = key.fileobj
                if obj is self.listener:
                    self.accept()
                elif obj == self.wakeup:
                    self.reap()
                elif obj == self.pidfd:
                    self.code = 255
                elif obj == self.stdout:
                    self.read_agent()
                elif obj == self.stdin:
                    self.write_agent()
                elif obj is self.client:
                    self.serve_client(ready)
        self.flush()
        return self.code

    def check_lease(self) -> None:
        """End the runtime if no gateway has held it, or renewed the lease, for the lease's length."""
        now = time.time()
        if self.client is not None:
            self.gateway_seen = now
            return
        try:
            renewed = os.stat(self.lease[0]).st_mtime
        except OSError:
            renewed = 0.0  # no file: only the last connection counts
        if now - max(renewed, self.gateway_seen) <= self.lease[1]:
            return
        sys.stderr.write(f"shim: no gateway for {self.lease[1]:g} s (lease {self.lease[0]}): ending the sandbox\n")
        self.lease_ended = True
        try:  # the launcher, or the sandbox: our child (not reaped, so its pid is its own) or pinned by a pidfd
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroup:
            thaw(self.cgroup)  # a frozen (paused in memory) sandbox takes its SIGKILL only once thawed

    def flush(self) -> None:
        """The runtime has exited: what it wrote before that still goes to the
        gateway (a second at most, so a stalled gateway cannot hold the exit)."""
        while not self.agent_eof:
            try:
                data = os.read(self.stdout, CHUNK)
            except OSError:  # BlockingIOError: a process it left behind holds the pipe open
                break
            if not data:
                break
            self.from_agent += data
            self.relay_agent()
        if self.client is not None and self.to_client:
            try:
                self.client.settimeout(1.0)
                self.client.sendall(self.to_client)
            except OSError:
                pass

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # out of descriptors, say: that gateway tries again; the sandbox runs on
            time.sleep(0.1)  # the listener stays readable: not a busy loop meanwhile
            return
        conn.setblocking(False)
        self.drop_client()
        self.client = conn
        self.gateway_seen = time.time()
        self.relay_agent()  # a frame that waited for a gateway goes now

    def drop_client(self) -> None:
        """That gateway is gone: its half frame and its unsent output with it."""
        if self.client is None:
            return
        self.watch(self.client, 0)
        self.client.close()
        self.client = None
        self.gateway_seen = time.time()
        self.from_client.clear()
        self.to_client.clear()

    def serve_client(self, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            try:
                sent = self.client.send(self.to_client)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return self.drop_client()
            del self.to_client[:sent]
        if events & selectors.EVENT_READ and self.client is not None:
            try:
                data = self.client.recv(CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                return self.drop_client()
            self.from_client += data
            self.take_whole_frames()

    def take_whole_frames(self) -> None:
        """Gateway -> agent: whole frames only, so a gateway killed mid-frame
        leaves nothing half-written in the agent's stream."""
        buf = self.from_client
        start = 0
        while len(buf) - start >= PREFIX.size:
            size = PREFIX.size + sum(PREFIX.unpack_from(buf, start))
            if size > MAX_FRAME:
                self.drop_client()  # not our gateway's framing: the agent would refuse it anyway
                return
            if len(buf) - start < size:
                break
            start += size
        if start:
            self.to_agent += memoryview(buf)[:start]
            del buf[:start]

    def write_agent(self) -> None:
        try:
            n = os.write(self.stdin, self.to_agent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the runtime is gone; its exit status comes with SIGCHLD
            self.to_agent.clear()
            return
        del self.to_agent[:n]

    def read_agent(self) -> None:
        try:
            data = os.read(self.stdout, CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self.agent_eof = True  # the runtime closed its stdout: it is exiting
            return
        self.from_agent += data
        self.relay_agent()

    def relay_agent(self) -> None:
        """Agent -> gateway, cut at frame boundaries."""
        buf = self.from_agent
        start = 0
        while start < len(buf):
            if not self.frame_left:
                if self.client is None or len(buf) - start < PREFIX.size:
                    break  # a new frame waits for a gateway, or for its whole prefix
                self.frame_left = PREFIX.size + sum(PREFIX.unpack_from(buf, start))
                self.frame_owner = self.client
            n = min(self.frame_left, len(buf) - start)
            if self.frame_owner is not None and self.frame_owner is self.client:
                self.to_client += memoryview(buf)[start:start + n]
            self.frame_left -= n
            start += n
        if start:
            del buf[:start]

    def reap(self) -> None:
        try:
            while os.read(self.wakeup, 512):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:  # every child: with --detached, the sandbox's gofer and helpers are ours too
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            self.exited[pid] = os.waitstatus_to_exitcode(status)
        self.settle()

    def settle(self) -> None:
        """The runtime's exit, if it has exited: a launcher that detached hands
        the role on to the sandbox it started, which may have exited already."""
        code = self.exited.pop(self.pid, None)
        if code is None:
            return
        if not self.pidfile or code != 0:
            self.code = code
            return
        pidfile, self.pidfile = self.pidfile, ""
        try:
            with open(pidfile) as f:
                self.pid = int(f.read())
            if self.pid <= 1:
                raise ValueError(f"pid {self.pid}")
        except (OSError, ValueError) as e:
            sys.stderr.write(f"shim: the launcher exited without naming its sandbox: {e}\n")
            self.code = 125
            return
        if self.pid in self.exited:
            return self.settle()
        try:  # (WNOWAIT: not reaped here, reap() does that)
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            self.watch_stranger()

    def watch_stranger(self) -> None:
        """The sandbox is not this shim's child (not seen, but its exit would
        otherwise never reach us): watch it through a pidfd instead; its exit
        status is then unknown (255)."""
        try:
            self.pidfd = os.pidfd_open(self.pid)  # first: the stat read below is then of this very process
            with open(f"/proc/{self.pid}/stat") as f:
                stat = f.read(200)
        except OSError as e:
            sys.stderr.write(f"shim: the sandbox {self.pid} is gone and was not this shim's child: {e}\n")
            self.code = 125
            return
        sys.stderr.write(f"shim: the sandbox is not this shim's child (/proc/{self.pid}/stat: {stat.strip()}); "
                         "watching it, its exit status will be unknown\n")
        self.sel.register(self.pidfd, selectors.EVENT_READ)


def spawn(argv: list):
    """Start the runtime on two fresh pipes; returns (pid, its stdin, its stdout)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[
        (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)],
        setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))  # Python ignores these; the runtime gets the defaults
    os.close(in_r)
    os.close(out_w)
    return pid, in_w, out_r  # os.pipe()'s fds are close-on-exec: the runtime has only its dup2'd ends


def children() -> list:
    """This process's children: as the subreaper, whatever the launcher left too."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN
        pass
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:  # the field after the name is the ppid
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def end_children(grace: float) -> None:
    """Let what is left of the sandbox (the gofer, once its Sentry is gone) exit
    within ``grace`` seconds, then kill and reap the rest: nothing may outlive
    the shim (it would be init's, and run on unseen)."""
    end = time.monotonic() + grace
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # none left
        if time.monotonic() >= end:
            break
        time.sleep(0.05)  # polled: the event loop that took SIGCHLD has ended
    for pid in children():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        while True:
            os.waitpid(-1, 0)
    except ChildProcessError:
        pass


def clean_up(argv: list, timeout: float = 30.0) -> None:
    """Run the cleanup command (runsc delete) to its end, or kill it after ``timeout``."""
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ)
    except OSError as e:
        sys.stderr.write(f"shim: cannot run {argv[0]}: {e}\n")
        return
    end = time.monotonic() + timeout
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > end:
            sys.stderr.write(f"shim: {' '.join(argv[-3:])} did not finish within {timeout:g} s\n")
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    end_children(0)  # whatever it left behind


def remove_cgroups(name: str) -> None:
    """rmdir ``name`` (``sandgate/<runtime id>``) in every cgroup hierarchy, v1 and v2.
    The kernel refuses to remove a cgroup that still holds a process or a child
    cgroup, so this never takes one from a sandbox that is still there."""
    import glob  # only here: most shims never get this far
    name = glob.escape(name)
    for d in glob.glob(f"/sys/fs/cgroup/*/{name}") + glob.glob(f"/sys/fs/cgroup/{name}"):
        try:
            os.rmdir(d)
        except OSError:
            pass


def thaw(name: str) -> None:
    """Thaw the freezer cgroup ``name`` (``sandgate/<runtime id>``), v1 or v2, if it is there."""
    for path, value in ((f"/sys/fs/cgroup/freezer/{name}/freezer.state", "THAWED"),
                        (f"/sys/fs/cgroup/{name}/cgroup.freeze", "0")):
        try:
            with open(path, "w") as f:
                f.write(value)
        except OSError:
            pass


def become_subreaper() -> None:
    """Orphans of our children become ours (prctl PR_SET_CHILD_SUBREAPER)."""
    import ctypes  # only here: the plain shim does without its memory
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def main(sock: str, status: str, argv: list, pidfile: str = "", cleanup: list = (), cgroup: str = "",
         lease: tuple = ()) -> int:
    if pidfile:
        become_subreaper()
        if os.path.exists(pidfile):
            os.unlink(pidfile)  # from an earlier run of this sandbox id: not this sandbox's pid
    # SIGCHLD wakes the loop through this pipe; the handler is set before the
    # child exists, so an early exit is not missed.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(sock):
        os.unlink(sock)  # a stale socket from an earlier run of this sandbox id
    old = os.umask(0o077)  # the socket is the gateway's (root's) alone
    try:
        listener.bind(sock)
    finally:
        os.umask(old)
    listener.listen(4)
    pid, stdin, stdout = spawn(argv)  # only once the socket is there: a shim that fails leaves no runtime behind
    shim = Shim(listener, pid, stdin, stdout, wake_r, pidfile, lease, cgroup)
    code = shim.run()
    listener.close()
    if pidfile:
        # The sandbox, a child of ours, ended: the gofer follows within moments. Otherwise the
        # launcher failed, or its sandbox was not ours to wait on: what it started is killed now.
        sandbox_ended = not shim.pidfile and shim.pidfd is None and code != 125
        end_children(5.0 if sandbox_ended else 0.0)
        if cleanup:
            clean_up(list(cleanup))
        if cgroup:
            remove_cgroups(cgroup)
    tmp = status + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(code))
    os.rename(tmp, status)
    return code


if __name__ == "__main__":
    sep = sys.argv.index("--")
    options = sys.argv[3:sep]
    detached = options[options.index("--detached") + 1] if "--detached" in options else ""
    cleanup = options[options.index("--cleanup") + 1:] if "--cleanup" in options else []
    own = options[:len(options) - len(cleanup)]
    cgroup = own[own.index("--cgroup") + 1] if "--cgroup" in own else ""
    lease = (own[own.index("--lease") + 1], float(own[own.index("--lease") + 2])) if "--lease" in own else ()
    rc = main(sys.argv[1], sys.argv[2], sys.argv[sep + 1:], detached, cleanup, cgroup, lease)
    sys.exit(rc if rc >= 0 else 128 - rc)

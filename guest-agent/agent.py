"""The guest agent: runs inside a sandbox, owns its kernel, speaks one stream.

It starts ipykernel (ipc transport), connects the four Jupyter channels, and
bridges them, plus file and command requests, to the gateway over a single
framed stream (see protocol.py). The agent, not the gateway, holds the
kernel: if the stream goes away the kernel keeps running and its messages are
buffered up to a bound; a reconnecting gateway gets them back, and a count of
whatever was dropped past the bound.

Transports: ``stdio`` (gVisor: the sandbox's stdin/stdout), ``unix:PATH`` and
``vsock:PORT`` (listen, one gateway at a time), ``serial:DEVICE``
(virtio-serial port). Needs only the Python standard library, pyzmq,
ipykernel and pydantic.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import datetime
import errno
import fcntl
import hashlib
import hmac
import json
import os
import posixpath
import re
import signal
import socket
import stat
import struct
import sys
import threading
import time
import uuid

import zmq
import zmq.asyncio

try:
    from . import kernel_pipe as KP
    from . import protocol as P
    from . import tunnel as T
except ImportError:  # run as a script
    import kernel_pipe as KP  # type: ignore
    import protocol as P  # type: ignore
    import tunnel as T  # type: ignore

DELIM = b"<IDS|MSG>"
OWN = b"sandgate-agent-"  # msg_id prefix of the agent's own kernel requests
IPC_PORTS = {"shell": 1, "iopub": 2, "stdin": 3, "control": 4, "hb": 5}


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
    agent's (pid 1) environment, memory map, status or anything else under /proc/1, which would
    tell it what the agent holds. A VM's agent is root with every capability and this works; gVisor's Sentry has no
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


RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def reseed_kernel_random(*extra: bytes) -> None:
    """A VM restored from a snapshot resumes its kernel's random generator
    where the snapshot left it: every copy of one checkpoint draws the same
    bytes (os.urandom, uuid4, the reseed in setup) until that kernel reseeds
    on its own, up to a minute later. So mix in what differs between copies
    (the host's clock at the restore, the time here to the nanosecond) and
    have the kernel reseed now. This makes the copies differ, not secret from
    each other: entropy from the host would. RNDRESEEDCRNG needs CAP_SYS_ADMIN,
    which a VM's agent has; in gVisor randomness comes from the host kernel and
    this does nothing (or fails, harmlessly)."""
    data = b"".join(extra) + struct.pack("<3q", time.time_ns(), time.monotonic_ns(), time.perf_counter_ns())
    try:
        fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.write(fd, data)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    except OSError:
        pass
    finally:
        os.close(fd)


def host_entropy(hexdigits: str) -> bytes:
    """The gateway's random bytes: with them, restored copies are not only
    different but unpredictable to each other."""
    try:
        return bytes.fromhex(hexdigits)
    except ValueError:
        return b""


class TRACE:
    """Opt-in spans, switched by the gateway (see Agent.trace_in)."""
    on = False
    read_at = 0.0  # when the stdin thread last read from the stream


def log(*args) -> None:
    print("sandgate-agent:", *args, file=sys.stderr, flush=True)


class Outbox:
    """Frames to the gateway: written when attached, buffered when not."""

    def __init__(self, max_frames: int, max_bytes: int):
        self.writer = None  # asyncio.StreamWriter or BlockingWriter
        self.buffer: collections.deque[bytes] = collections.deque()
        self.buffered_bytes = 0
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.dropped = 0
        self.dropped_bytes = 0

    async def send(self, data: bytes) -> None:
        await self.send_all([data])

    async def send_all(self, frames: list[bytes]) -> None:
        """Frames in one write: each write to the stream wakes the shim and the
        gateway on the host, and costs the sandbox a trip through the Sentry."""
        w = self.writer
        if w is not None and getattr(w, "is_closing", lambda: False)():
            w = self.writer = None  # asyncio swallows write errors on a dead socket
        if w is not None:
            try:
                w.write(frames[0] if len(frames) == 1 else b"".join(frames))
                await w.drain()
                return
            except (ConnectionError, OSError):
                self.writer = None
                log("stream lost; buffering")
        for data in frames:
            self._keep(data)

    def _keep(self, data: bytes) -> None:
        # Past the bound, newer frames are dropped: the buffered prefix stays
        # a consistent history, and the gateway is told how much is missing.
        if len(self.buffer) >= self.max_frames or self.buffered_bytes + len(data) > self.max_bytes:
            self.dropped += 1
            self.dropped_bytes += len(data)
            return
        self.buffer.append(data)
        self.buffered_bytes += len(data)

    async def attach(self, writer: asyncio.StreamWriter) -> None:
        if self.dropped:
            writer.write(P.encode(P.EventFrame(event="dropped", data={
                "frames": self.dropped, "bytes": self.dropped_bytes})))
            self.dropped = self.dropped_bytes = 0
        while self.buffer:
            writer.write(self.buffer.popleft())
        self.buffered_bytes = 0
        self.writer = writer
        await writer.drain()

    def detach(self) -> None:
        self.writer = None


SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Bring ``lo`` up if it is down: a VM's kernel leaves it down and its
    init does not touch it (gVisor's --network=none has it up already). The
    kernel gives an up loopback 127.0.0.1/8 by itself."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
            log("brought the loopback interface up")


SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
NO_PROXY = "localhost,127.0.0.1,::1"


class Egress:
    """The sandbox's way out: a listener on 127.0.0.1:PORT, owned by the agent,
    that code inside uses as its HTTP(S) proxy; each connection is carried
    over the stream (tunnel.Mux) to the gateway, which hands it to the egress
    proxy outside. No network device is involved.

    This runsc cannot checkpoint a TCP socket, listening or not, so
    ``quiesce`` closes the listener and every connection before a checkpoint
    (clients get a reset), and ``apply`` (from ``egress`` or ``reconnect``)
    opens the listener again."""

    def __init__(self, out: "Outbox", ca_dir: str):
        self.mux = T.Mux(out.send)
        self.server: asyncio.base_events.Server | None = None
        self.port: int | None = None
        self.ca_pem = ""
        self.ca_dir = ca_dir
        self.env: dict[str, str] = {}  # what the agent and the kernel have now

    def env_for(self, port: int | None, bundle: str | None) -> dict[str, str]:
        if port is None:
            return {}
        proxy = f"http://127.0.0.1:{port}"
        env = {k: proxy for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
        env.update(NO_PROXY=NO_PROXY, no_proxy=NO_PROXY)
        if bundle:
            env.update({k: bundle for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")})
        return env

    def write_bundle(self, ca_pem: str) -> str:
        """The image's system bundle plus the proxy's CA, in a directory of the
        agent's own (root's, made before the kernel ran), not the workspace."""
        st = os.lstat(self.ca_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"refusing to write the CA bundle: {self.ca_dir} is not the agent's directory")
        try:
            with open(SYSTEM_CA_BUNDLE, "rb") as f:
                system = f.read()
        except OSError:
            system = b""
        path = os.path.join(self.ca_dir, "ca-bundle.pem")
        tmp = f"{path}.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(system.rstrip(b"\n") + b"\n" + ca_pem.strip().encode() + b"\n")
        os.replace(tmp, path)
        return path

    async def apply(self, port: int | None, ca_pem: str) -> dict[str, str]:
        """Make the listener match (open, move, close); returns the env to set."""
        if port != self.port:
            await self.close("egress turned off" if port is None else "egress moved to another port")
        self.port = port
        if port is not None and self.server is None:
            try:
                loopback_up()
            except OSError as e:
                log(f"cannot bring the loopback interface up: {e}")
            self.server = await asyncio.start_server(self.accept, "127.0.0.1", port, reuse_address=True)
        bundle = None
        if port is not None and ca_pem:
            bundle = self.write_bundle(ca_pem) if ca_pem != self.ca_pem or "SSL_CERT_FILE" not in self.env \
                else self.env["SSL_CERT_FILE"]
        self.ca_pem = ca_pem if port is not None else ""
        return self.env_for(port, bundle)

    async def close(self, why: str) -> int:
        """Close the listener and abort every connection (the port is kept:
        ``apply`` reopens it)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        return await self.mux.close_all(why)

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.server is None or self.mux.full():
            T._abort(writer)
            return
        await self.mux.connect(reader, writer)


class KernelSession:
    """What the agent needs of a Jupyter session: the key that signs messages
    to the kernel (HMAC-SHA256 over header, parent header, metadata and content)
    and the headers of its own requests. Not jupyter_client's Session: importing
    it costs the agent ~8 MiB of memory in every sandbox, for these few lines."""

    PROTOCOL_VERSION = "5.3"

    def __init__(self):
        self.key = uuid.uuid4().hex.encode()
        self.session = str(uuid.uuid4())

    def sign(self, parts: list[bytes]) -> bytes:
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.hexdigest().encode()

    def request(self, msg_id: str, msg_type: str, content: dict) -> list[bytes]:
        """A request's header, parent header, metadata and content, serialized."""
        date = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
        header = {"msg_id": msg_id, "msg_type": msg_type, "username": "sandgate-agent", "session": self.session,
                  "date": date, "version": self.PROTOCOL_VERSION}
        return [json.dumps(part).encode() for part in (header, {}, {}, content)]


class KernelProcess:
    """One ipykernel process and the agent's sockets to it: ZMQ for control,
    stdin and the heartbeat; shell and IOPub over a pipe (kernel_pipe.py)
    when the kernel is the agent's own and says it took it, else ZMQ too."""

    def __init__(self, runtime_dir: str, workspace: str, argv: list[str] | None, user: int | None = None):
        self.user = user
        self.dir = runtime_dir
        self.workspace = workspace
        self.argv = argv
        self.session = KernelSession()
        self.ctx = zmq.asyncio.Context()
        self.proc: asyncio.subprocess.Process | None = None
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.ident = b""
        # The pipe to this kernel process (None for a kernelspec's own argv),
        # and whether the kernel said it carries shell and IOPub.
        self.pipe: KP.AgentEnd | None = None
        self.on_pipe = False
        self.conn_file = os.path.join(runtime_dir, "kernel.json")
        os.makedirs(runtime_dir, exist_ok=True)
        ports = {f"{name}_port": port for name, port in IPC_PORTS.items()}
        with open(self.conn_file, "w") as f:
            json.dump(dict(transport="ipc", ip=os.path.join(runtime_dir, "k"), key=self.session.key.decode(),
                           signature_scheme="hmac-sha256", kernel_name="python3", **ports), f)
        if user is not None:  # the kernel binds its ipc sockets here as that user
            os.chown(runtime_dir, user, user)
            os.chown(self.conn_file, user, user)

    def endpoint(self, name: str) -> str:
        return f"ipc://{os.path.join(self.dir, 'k')}-{IPC_PORTS[name]}"

    def connect(self) -> None:
        """(Re)open the agent's sockets. After a checkpoint is restored the old
        connections are dead but look alive, so new ones are made, under a
        new identity: the kernel's ROUTER refuses a second peer with the old one."""
        for s in self.sockets.values():
            s.close(linger=0)
        ident = self.ident = uuid.uuid4().hex.encode()
        self.sockets = {}
        for name, kind in (("shell", zmq.DEALER), ("control", zmq.DEALER), ("stdin", zmq.DEALER), ("iopub", zmq.SUB)):
            if self.on_pipe and name in ("shell", "iopub"):
                continue  # the kernel binds no IOPub socket then: a SUB would retry its connect forever
            s = self.ctx.socket(kind)
            s.linger = 0
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                # stdin must share the shell identity: the kernel sends
                # input_request to the identity that sent execute_request.
                s.setsockopt(zmq.IDENTITY, ident)
            s.connect(self.endpoint(name))
            self.sockets[name] = s

    async def spawn(self) -> None:
        """Start the process; the caller has closed the last one's pipe."""
        argv, env, fds, kernel_end = self.argv, None, (), None
        if argv is None:  # the agent's own kernel: offer it the pipe
            argv = [sys.executable, "-m", "sandgate_agent.kernel"]
            agent_end, kernel_end = KP.pair()
            self.pipe = KP.AgentEnd(agent_end, asyncio.get_running_loop())
            env, fds = {**os.environ, KP.ENV: str(kernel_end.fileno())}, (kernel_end.fileno(),)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *argv, "-f", self.conn_file, cwd=self.workspace, env=env, pass_fds=fds,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=sys.stderr.fileno(),
                start_new_session=True, **as_user(self.user))
        finally:
            if kernel_end is not None:
                kernel_end.close()

    def pipe_frame(self, sig: bytes, parts: list[bytes]) -> bytes:
        # The shell identity goes first, as a ROUTER would add it: the kernel
        # sends input_request on stdin (ZMQ) to that identity.
        return KP.encode(KP.SHELL, [self.ident, DELIM, sig, *parts])

    def close_pipe(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
        self.pipe, self.on_pipe = None, False

    async def send(self, channel: str, parts: list[bytes]) -> None:
        sig = self.session.sign(parts[:4])
        if channel == "shell" and self.on_pipe:
            pipe = self.pipe
            try:
                pipe.write(self.pipe_frame(sig, parts))
            except OSError as e:  # a kernel that died: watch() starts the next one
                log(f"a shell message for a kernel that is gone was dropped: {e}")
                return
            await pipe.room()
            return
        await self.sockets[channel].send_multipart([DELIM, sig, *parts])

    async def kill(self) -> None:
        p = self.proc
        if p and p.returncode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await p.wait()

    def interrupt(self) -> None:
        if self.proc and self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGINT)

    async def heartbeat(self, timeout: float = 1.0) -> bool:
        s = self.ctx.socket(zmq.REQ)
        s.linger = 0
        s.connect(self.endpoint("hb"))
        try:
            await s.send(b"ping")
            return bool(await s.poll(int(timeout * 1000)))
        finally:
            s.close()


O_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# setresuid, setresgid, setgroups: called directly, they change the calling
# thread's credentials only (see Workspace.acting_as_user).
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


class Workspace:
    """The files API, done so that the agent is no deputy for the code in the
    sandbox.

    The agent is root with CAP_DAC_OVERRIDE; the kernel's user controls every
    name in the workspace and can swap a directory for a symlink at any
    moment. So a path is never resolved and then opened: it is walked one
    component at a time from a descriptor of the workspace, each component
    opened with O_NOFOLLOW relative to the previous directory's descriptor
    and its type checked with fstat (``open_at``); the operation then works
    on descriptors only. A symlink anywhere is refused (even one pointing
    inside: it could be swapped afterwards), a FIFO or device is refused
    without blocking, and '..' is resolved by name, which is exact when no
    symlink is followed. (openat2's RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS would
    do the walk in one call, but runsc 20221219 answers ENOSYS; the walk works
    everywhere, so it is the only path.)

    And every file operation runs as the sandbox user (``acting_as_user``), so
    its permissions are the kernel's own: a 0600 root file or a 0000 file is
    refused by the kernel's own check, as it would be for the cell."""

    def __init__(self, path: str, user: int | None):
        self.path = path
        self.user = user
        # Only a root agent serving another user switches; the tests' agent
        # runs as whoever started it, with no --user.
        self.switch = user is not None and user != 0 and os.geteuid() == 0
        self.egid, self.groups = os.getegid(), os.getgroups()
        self.creds = ThreadCredentials()

    @contextlib.contextmanager
    def acting_as_user(self):
        """Effective uid/gid of the sandbox user, and no supplementary groups,
        for the duration of one file operation.

        Credentials are per thread in Linux; glibc's set*id (what os.setresuid
        calls) applies them to every thread, the raw system calls only to the
        calling one (``ThreadCredentials``). Either is safe here because every
        file operation runs synchronously on the event loop's thread, with no
        await between the switch and its undo: no other task of the agent can
        run as the user meanwhile (a kernel spawn would fail), and the other
        threads (stdin reader, zmq I/O) only move bytes on descriptors they
        already hold. Real and saved uid stay 0, which is how the effective
        uid comes back, and which keeps the kernel's user from signalling or
        tracing the agent meanwhile (both check the target's real and saved
        uid). With the raw calls the operations could move to a worker thread
        and stop blocking the loop on big files; with the glibc fallback they
        could not, so they stay on the loop."""
        if not self.switch:
            yield
            return
        creds = self.creds
        try:
            if self.groups:
                creds.setgroups([])
            creds.setresgid(-1, self.user, -1)
            creds.setresuid(-1, self.user, -1)
            yield
        finally:
            creds.setresuid(-1, 0, -1)
            creds.setresgid(-1, self.egid, -1)
            if self.groups:
                creds.setgroups(self.groups)

    @staticmethod
    def components(path: str) -> list[str]:
        norm = posixpath.normpath(path.lstrip("/"))
        if norm == ".":
            return []
        if norm == ".." or norm.startswith("../"):
            raise PermissionError(f"{path!r} is outside the workspace")
        return norm.split("/")

    @staticmethod
    def open_at(dfd: int, name: str, path: str, directory: bool) -> int:
        """Open ``name`` in the directory ``dfd`` without following a symlink;
        a directory when ``directory``, otherwise a regular file.

        O_NOFOLLOW without O_DIRECTORY: given both, runsc 20221219 follows a
        symlink to a directory. So the type is checked on the descriptor, and
        O_NONBLOCK keeps the open of a FIFO from waiting for a writer."""
        try:
            fd = os.open(name, O_OPEN, dir_fd=dfd)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # with O_NOFOLLOW: the name is a symlink
                raise PermissionError(f"refusing to follow a symlink in {path!r}") from None
            raise
        mode = os.fstat(fd).st_mode
        if directory and not stat.S_ISDIR(mode):
            os.close(fd)
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        if not directory and not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
            raise PermissionError(f"refusing to read {path!r}: not a regular file")
        return fd

    def open_dir(self, parts: list[str], path: str, create: bool = False) -> int:
        """A descriptor of the directory at ``parts`` beneath the workspace,
        no symlink followed; missing directories are made if ``create``."""
        fd = os.open(self.path, O_OPEN)
        try:
            for name in parts:
                try:
                    nfd = self.open_at(fd, name, path, directory=True)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, 0o755, dir_fd=fd)
                    except FileExistsError:  # made meanwhile: whatever it is, open_at checks it
                        pass
                    nfd = self.open_at(fd, name, path, directory=True)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def read_file(self, path: str, offset: int = 0, length: int = 0) -> tuple:
        """(bytes, the file's stat): ``length`` bytes from ``offset``, or the whole file (length 0)."""
        parts = self.components(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        dfd = self.open_dir(parts[:-1], path)
        try:
            fd = self.open_at(dfd, parts[-1], path, directory=False)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if length:
                return os.pread(f.fileno(), min(length, P.MAX_PAYLOAD), max(0, offset)), st
            data = f.read(P.MAX_PAYLOAD + 1)
        if len(data) > P.MAX_PAYLOAD:
            raise P.ProtocolError(f"{path!r} is larger than a frame's payload ({P.MAX_PAYLOAD >> 20} MiB)")
        return data, st

    def write_file(self, path: str, data: bytes, mode: int) -> None:
        parts = self.components(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        name = parts[-1]
        dfd = self.open_dir(parts[:-1], path, create=True)
        try:
            self._writable_name(dfd, name, path)
            # Written to a temporary name and renamed: readers never see half a
            # file, and the rename replaces whatever entry is there by then
            # (even a symlink swapped in) without following it.
            # Not derived from the name: a name near the file system's 255-byte limit would push it past.
            tmp = f".sandgate-{uuid.uuid4().hex[:16]}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    # On disk before the write is acknowledged: a VM that is
                    # killed keeps what was acknowledged.
                    os.fsync(f.fileno())
                    os.fchmod(f.fileno(), mode & 0o777)  # never setuid, setgid or sticky
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
            os.fsync(dfd)
        finally:
            os.close(dfd)

    UPLOAD = re.compile(r"[0-9a-f]{8,32}")

    def write_part(self, path: str, upload: str, offset: int, data: bytes, last: bool, mode: int) -> int:
        """One chunk of a file the gateway streams: appended at ``offset`` to the temporary file
        ``.sandgate-<upload>.part`` (made at offset 0; not named after the file, whose name may be
        as long as a name can be), renamed over the file with the last chunk,
        so readers never see half a file, as with write_file. Each chunk opens the temporary file
        again: nothing is held between two, and a checkpoint may come between them."""
        parts = self.components(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not self.UPLOAD.fullmatch(upload):
            raise ValueError(f"bad upload id {upload!r}")
        name = parts[-1]
        tmp = f".sandgate-{upload}.part"
        dfd = self.open_dir(parts[:-1], path, create=offset == 0)
        try:
            flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if offset == 0 else 0)
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    if offset == 0 or last:  # refused before the first byte, and checked again before the rename
                        self._writable_name(dfd, name, path)
                    if os.fstat(f.fileno()).st_size != offset:  # a chunk lost or repeated: not this file
                        raise ValueError(f"upload {upload} of {path!r} is at {os.fstat(f.fileno()).st_size}, not {offset}")
                    f.seek(offset)
                    f.write(data)
                    if last:
                        f.flush()
                        os.fsync(f.fileno())
                        os.fchmod(f.fileno(), mode & 0o777)  # never setuid, setgid or sticky
                if last:
                    # Replaces whatever entry is there by then (even a symlink swapped in) without following it.
                    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    os.fsync(dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
        finally:
            os.close(dfd)
        return offset + len(data)

    @staticmethod
    def _writable_name(dfd: int, name: str, path: str) -> None:
        """A symlink is never written through, a directory never replaced (write_file, write_part)."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise PermissionError(f"refusing to write through the symlink {path!r}")
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)

    def abort_part(self, path: str, upload: str) -> None:
        """An upload that will not finish: its temporary file goes."""
        parts = self.components(path)
        if not parts or not self.UPLOAD.fullmatch(upload):
            return
        try:
            dfd = self.open_dir(parts[:-1], path)
        except OSError:
            return
        try:
            os.unlink(f".sandgate-{upload}.part", dir_fd=dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)

    def directory(self, path: str) -> int:
        return self.open_dir(self.components(path), path)

    def list_dir(self, path: str) -> list[dict]:
        fd = self.directory(path)
        entries = []
        try:
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:  # gone since the listing was read
                        continue
                    kind = ("directory" if stat.S_ISDIR(st.st_mode) else
                            "symlink" if stat.S_ISLNK(st.st_mode) else "file")
                    entries.append({"name": e.name, "type": kind, "size": st.st_size, "mtime": st.st_mtime})
        finally:
            os.close(fd)
        return sorted(entries, key=lambda e: e["name"])

    def delete(self, path: str) -> None:
        parts = self.components(path)
        if not parts:
            raise PermissionError("refusing to delete the workspace itself")
        dfd = self.open_dir(parts[:-1], path)
        try:
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None
            if stat.S_ISDIR(st.st_mode):
                self._rmtree(dfd, parts[-1], path)
            else:  # a symlink goes itself, never what it points to
                os.unlink(parts[-1], dir_fd=dfd)
        finally:
            os.close(dfd)

    def _rmtree(self, dfd: int, name: str, path: str) -> None:
        """Like shutil.rmtree with dir_fd, but every directory is opened with
        open_at: an entry swapped for a FIFO or a symlink meanwhile fails the
        delete instead of blocking or being followed. Iterative, with one
        descriptor per level held: a tree deeper than Python's recursion
        limit (a cell makes one in a second) is deleted like any other."""
        stack = [(dfd, name, self.open_at(dfd, name, path, directory=True), None)]
        try:
            while stack:
                parent, dname, fd, entries = stack[-1]
                if entries is None:
                    with os.scandir(fd) as it:
                        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                    stack[-1] = (parent, dname, fd, entries)
                if entries:
                    child, is_dir = entries.pop()
                    if is_dir:
                        stack.append((fd, child, self.open_at(fd, child, path, directory=True), None))
                    else:
                        os.unlink(child, dir_fd=fd)
                    continue
                stack.pop()
                os.close(fd)
                os.rmdir(dname, dir_fd=parent)
        finally:
            for _, _, fd, _ in stack:
                os.close(fd)

    def run(self, fn, path: str, *args):
        """One file operation as the sandbox user. What that user may not do
        is refused (403 at the gateway), like what is outside the workspace."""
        try:
            with self.acting_as_user():
                return fn(path, *args)
        except PermissionError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                raise PermissionError(f"refusing {path!r}: permission denied to the sandbox user") from None
            raise


class Agent:
    def __init__(self, args: argparse.Namespace):
        self.workspace = os.path.realpath(args.workspace)
        os.makedirs(self.workspace, exist_ok=True)
        self.out = Outbox(args.buffer_frames, args.buffer_bytes)
        self.user = args.user
        self.files = Workspace(self.workspace, args.user)
        self.kernel = KernelProcess(args.runtime_dir, self.workspace, args.kernel_cmd, args.user)
        self.ready = asyncio.Event()
        self.restarting = False
        self.waiters: dict[str, tuple] = {}  # own msg_id -> (shell reply, iopub seen)
        self.deaths: collections.deque[float] = collections.deque(maxlen=5)
        self.pumps: list[asyncio.Future] = []
        self.pipe_pump: asyncio.Future | None = None
        self.fast: ShellFastPath | None = None  # stdio only
        self.malformed, self.malformed_logged = 0, 0.0  # messages from the kernel dropped, not yet logged
        self.restored_at = b""  # the host's clock sent with the last reconnect
        # Opt-in spans (gateway/trace.py): on while the gateway's kernel frames
        # ask for them; the stamps of each traced request, by its msg_id, go
        # back on the messages that answer it.
        self.traced: collections.OrderedDict[str, dict] = collections.OrderedDict()
        ca_dir = args.runtime_dir.rstrip("/") + "-egress"  # made now, before any code of the user runs
        os.makedirs(ca_dir, mode=0o755, exist_ok=True)
        self.egress = Egress(self.out, ca_dir)

    def connect_kernel(self) -> None:
        for t in self.pumps:
            t.cancel()
        self.kernel.connect()
        self.pumps = [asyncio.ensure_future(self.pump(ch)) for ch in self.kernel.sockets]
        for t in self.pumps:
            t.add_done_callback(self.pump_ended)

    @staticmethod
    def pump_ended(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            log(f"a kernel channel pump stopped: {task.exception()!r}")

    # -- kernel side ----------------------------------------------------
    async def start_kernel(self) -> dict:
        """Start a kernel (first start, restart, after a crash) on new
        sockets and pumps: whatever the last kernel left on the old ones, and
        whatever became of their pumps, the new kernel starts clean."""
        self.kernel.close_pipe()  # on ZMQ until the new kernel says otherwise
        self.connect_kernel()
        if self.pipe_pump is not None:
            self.pipe_pump.cancel()
        await self.kernel.spawn()
        hello = None
        if self.kernel.pipe is not None:
            hello = asyncio.get_running_loop().create_future()
            self.pipe_pump = asyncio.ensure_future(self.pump_pipe(self.kernel.pipe.sock, hello))
            self.pipe_pump.add_done_callback(self.pump_ended)
        asyncio.ensure_future(self.watch(self.kernel.proc))
        info = await self.kernel_info()
        if hello is not None:
            # The kernel says which way its shell goes before it opens any
            # socket, so this has long arrived unless the kernel is gone.
            self.kernel.on_pipe = await asyncio.wait_for(hello, 30) == b"pipe"
            if self.kernel.on_pipe:
                self.connect_kernel()  # control and stdin only, from now on
        self.ready.set()
        return {"pid": self.kernel.proc.pid, "language_info": info.get("language_info", {})}

    async def own_request(self, msg_type: str, content: dict, timeout: float, channel: str = "shell") -> dict:
        """A request of the agent's own; its reply and output are not forwarded.
        Returns once the reply has come *and* iopub has carried its output."""
        msg_id = OWN.decode() + uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        reply, published = loop.create_future(), loop.create_future()
        self.waiters[msg_id] = (reply, published)
        parts = self.kernel.session.request(msg_id, msg_type, content)
        try:
            await self.kernel.send(channel, parts)
            await asyncio.wait_for(asyncio.gather(reply, published), timeout)
            return reply.result()
        finally:
            self.waiters.pop(msg_id, None)

    async def kernel_info(self, deadline: float = 120.0) -> dict:
        """Ask until the kernel answers: the first requests may go out before
        it has bound its sockets, and a SUB socket misses what is published
        before it has connected (ipykernel 6 sends no welcome message)."""
        t_end = time.monotonic() + deadline
        while time.monotonic() < t_end:
            if self.kernel.proc.returncode is not None:
                raise RuntimeError(f"kernel exited with status {self.kernel.proc.returncode} during start")
            try:
                # On control: shell waits behind a cell that is running (one the
                # checkpoint caught mid-way runs on after a restore).
                return await self.own_request("kernel_info_request", {}, 1.0, channel="control")
            except asyncio.TimeoutError:
                pass
        raise RuntimeError("kernel did not answer kernel_info within the deadline")

    async def watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if proc is not self.kernel.proc or self.restarting:
            return
        self.ready.clear()
        log(f"kernel exited with status {code}")
        await self.out.send(P.encode(P.EventFrame(event="kernel_died", data={"exit_code": code})))
        now = time.monotonic()
        self.deaths.append(now)
        if len(self.deaths) == self.deaths.maxlen and now - self.deaths[0] < 60:
            await self.out.send(P.encode(P.EventFrame(event="kernel_died", data={
                "exit_code": code, "final": True, "reason": "kernel died 5 times within 60 s"})))
            return
        try:
            info = await self.start_kernel()
        except Exception as e:
            await self.out.send(P.encode(P.EventFrame(event="kernel_died", data={
                "exit_code": code, "final": True, "reason": str(e)})))
            return
        await self.out.send(P.encode(P.EventFrame(event="kernel_restarted", data=info)))

    async def pump(self, channel: str) -> None:
        sock = self.kernel.sockets[channel]
        while True:
            msg = await sock.recv_multipart()
            frame = self.forward_frame(channel, msg, time.time() if TRACE.on else None)
            if frame is not None:
                await self.out.send(frame)

    async def pump_pipe(self, pipe: socket.socket, hello: asyncio.Future) -> None:
        """Shell and IOPub from the kernel over its pipe, in the order it sent
        them; whatever one read brings goes to the gateway in one write."""
        loop = asyncio.get_running_loop()
        decoder = KP.Decoder(cap=P.MAX_PAYLOAD + (1 << 20))
        try:
            while True:
                try:
                    data = await loop.sock_recv(pipe, KP.READ_SIZE)
                except OSError:
                    data = b""
                if not data:
                    return  # the kernel is gone (watch() says so), or it took ZMQ and closed its end
                received = time.time() if TRACE.on else None
                batch = []
                for channel, parts in decoder.feed(data):
                    if channel == KP.HELLO and isinstance(parts, list):
                        if not hello.done():
                            hello.set_result(parts[0] if parts else b"")
                    elif channel not in KP.CHANNELS:
                        self.count_malformed("pipe", ValueError(f"unknown channel {channel}"))
                    elif isinstance(parts, KP.PipeError):
                        self.count_malformed(KP.CHANNELS[channel], parts)
                    elif parts is None:
                        log(f"dropping a {KP.CHANNELS[channel]} message bigger than a frame")
                        self.out.dropped += 1
                    else:
                        frame = self.forward_frame(KP.CHANNELS[channel], parts, received)
                        if frame is not None:
                            batch.append(frame)
                if batch:
                    await self.out.send_all(batch)
        finally:
            if not hello.done():
                hello.set_result(b"")

    def forward_frame(self, channel: str, msg: list[bytes], received: float | None) -> bytes | None:
        try:
            return self.from_kernel(channel, msg, received)
        except Exception as e:
            # Code in the kernel can send anything on these sockets (it holds
            # the connection file and the pipe): a message that is not a
            # Jupyter message is dropped, and the pump goes on.
            self.count_malformed(channel, e)
            return None

    def count_malformed(self, channel: str, e: Exception) -> None:
        self.malformed += 1
        if time.monotonic() - self.malformed_logged >= 1:  # at most a line a second
            log(f"dropped {self.malformed} malformed message(s) from the kernel, the last on {channel}: "
                f"{type(e).__name__}: {e}"[:300])
            self.malformed, self.malformed_logged = 0, time.monotonic()

    def from_kernel(self, channel: str, msg: list[bytes], received: float | None = None) -> bytes | None:
        """The frame to forward for one message from the kernel, or None when
        it answers one of the agent's own requests. Raises ValueError (or any
        JSON error) for a message that is not a Jupyter message: the gateway
        and its clients parse these parts, so only JSON objects go out."""
        try:
            parts = msg[msg.index(DELIM) + 2:]
        except ValueError:
            raise ValueError("no delimiter") from None
        if len(parts) < 4:
            raise ValueError(f"{len(parts)} parts after the delimiter")
        header, parent, metadata, content = (json.loads(p) for p in parts[:4])
        if not all(isinstance(x, dict) for x in (header, parent, metadata, content)):
            raise ValueError("a part is not a JSON object")
        if not (isinstance(header.get("msg_id"), str) and isinstance(header.get("msg_type"), str)):
            raise ValueError("a header without msg_id or msg_type")
        parent_id = parent.get("msg_id")
        if isinstance(parent_id, str) and parent_id.startswith(OWN.decode()):
            # A reply to (or output of) the agent's own request.
            waiter = self.waiters.get(parent_id)
            if waiter:
                fut = waiter[0] if channel in ("shell", "control") else waiter[1]
                if not fut.done():
                    fut.set_result(content)
            return None
        trace = None
        if received is not None:
            trace = {**self.traced.get(parent_id, {}), "ag_recv": received, "ag_out": time.time()}
        try:
            return P.encode_kernel(channel, parts, trace)
        except P.ProtocolError as e:  # bigger than a frame may be: say so, keep going
            log(f"dropping a {channel} message: {e}")
            self.out.dropped += 1
            return None

    # -- gateway side ---------------------------------------------------
    async def serve(self, reader: asyncio.StreamReader, writer) -> str:
        """Serve one gateway connection; returns why it ended."""
        await self.out.attach(writer)
        try:
            while True:
                try:
                    frame, payload = await P.read_frame(reader)
                except EOFError:
                    return "the gateway closed the stream"
                except ConnectionError as e:  # a reset is an end (ResetIsEnd); anything else breaks it
                    return f"the gateway's stream broke: {e}"
                if isinstance(frame, P.KernelFrame):
                    if frame.channel == "iopub":
                        continue
                    await self.ready.wait()
                    parts = P.split_parts(frame, payload)
                    TRACE.on = frame.trace is not None
                    stamps = self.trace_in(frame, parts) if TRACE.on else None
                    try:
                        await self.kernel.send(frame.channel, parts)
                    finally:
                        if self.fast is not None and frame.channel == "shell":
                            self.fast.sent_one()
                    if stamps is not None:
                        stamps["ag_zmq"] = time.time()
                elif isinstance(frame, P.RequestFrame):
                    asyncio.ensure_future(self.answer(frame, payload))
                elif isinstance(frame, P.TunnelFrame):
                    self.egress.mux.on_frame(frame, payload)
        except P.ProtocolError as e:
            log(f"protocol error, dropping the connection: {e}")
            return f"protocol error from the gateway: {e}"
        finally:
            if self.out.writer is writer:
                self.out.detach()
            # Tunnelled connections live on one stream: the next gateway knows none of them.
            await self.egress.mux.close_all("the gateway's stream ended", tell_peer=False)

    def trace_in(self, frame: P.KernelFrame, parts: list[bytes], read_at: float | None = None) -> dict | None:
        """The stamps of a traced request, kept for the messages answering it."""
        try:
            msg_id = json.loads(parts[0])["msg_id"]
        except (ValueError, KeyError, TypeError):
            return None
        stamps = {**frame.trace, "ag_read": read_at or TRACE.read_at, "ag_in": time.time()}
        self.traced[msg_id] = stamps
        while len(self.traced) > 64:
            self.traced.popitem(last=False)
        return stamps

    async def answer(self, req: P.RequestFrame, payload: bytes) -> None:
        data = b""
        try:
            model = P.OP_ARGS.get(req.op)
            if model is None:
                raise ValueError(f"unknown op {req.op!r}")
            result, data = await getattr(self, "op_" + req.op)(model(**req.args), payload)
            resp = P.ResponseFrame(id=req.id, ok=True, result=result)
            frame = P.encode(resp, data)
        except P.ProtocolError as e:  # an answer past the frame's bounds (a listing of 20,000 long names)
            frame = P.encode(P.ResponseFrame(id=req.id, ok=False, error=f"AnswerTooLarge: {req.op}: {e}"))
        except Exception as e:
            frame = P.encode(P.ResponseFrame(id=req.id, ok=False, error=f"{type(e).__name__}: {e}"))
        await self.out.send(frame)

    async def op_ping(self, a, _):
        alive = self.kernel.proc is not None and self.kernel.proc.returncode is None
        return {"kernel_alive": alive, "kernel_responding": alive and await self.kernel.heartbeat(),
                "pid": self.kernel.proc.pid if self.kernel.proc else None,
                "buffered": len(self.out.buffer), "agent_version": P.VERSION,
                "kernel_transport": "pipe" if self.kernel.on_pipe else "zmq",
                "tunnels": len(self.egress.mux.conns), "egress_port": self.egress.port if self.egress.server else None}, b""

    async def op_reconnect(self, a, _):
        """Sent by the gateway after restoring a checkpoint: the kernel must
        answer. Its sockets normally survive the restore (and with them the
        replies of a cell that was running); if they do not, they are made
        anew, at the cost of what was in flight on the old ones."""
        self.ready.clear()
        if a.clock and abs(time.time() - a.clock) > 0.5:
            try:  # needs CAP_SYS_TIME: a VM's agent has it; in gVisor the clock is the host's anyway
                time.clock_settime(time.CLOCK_REALTIME, a.clock)
            except OSError:
                pass
        self.restored_at = repr(a.clock).encode()
        reseed_kernel_random(self.restored_at, host_entropy(a.entropy))
        info, setup = await self._restored_kernel(a.setup)
        if setup is not None:
            try:
                await setup
                info = {**info, "setup": True}
            except Exception as e:  # the sandbox's failure, not the restore's: said apart
                info = {**info, "setup": False, "setup_error": f"{type(e).__name__}: {e}"}
        self.ready.set()
        # The listener was closed before the checkpoint: open it again (or keep it closed).
        # A failure here costs the sandbox its egress, not its restore.
        try:
            await self.set_egress(a.egress or P.EgressArgs())
        except Exception as e:
            log(f"could not restore egress: {type(e).__name__}: {e}")
            info = {**info, "egress_error": f"{type(e).__name__}: {e}"}
        return info, b""

    async def _restored_kernel(self, setup) -> tuple:
        """The restored kernel's kernel_info (on control), with ``setup``'s cell
        (if any) sent on shell meanwhile. If the kernel's sockets did not
        survive the restore, they are made anew and the setup is sent again on
        them (its cell went to the old ones). Returns the info and the setup's
        task, or None without a setup: the caller awaits it."""
        task = asyncio.ensure_future(self.setup(setup)) if setup is not None else None
        try:
            return await self.kernel_info(deadline=5), task
        except RuntimeError:
            log("kernel sockets did not survive the restore; reconnecting")
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        except BaseException:
            if task is not None:
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" log
            raise
        self.connect_kernel()
        info = await self.kernel_info()
        return info, asyncio.ensure_future(self.setup(setup)) if setup is not None else None

    async def set_egress(self, a) -> dict:
        env = await self.egress.apply(a.port, a.ca_pem)
        old = self.egress.env
        if env != old:
            gone = [k for k in old if k not in env]
            await self.kernel_env(env, gone)
            self.egress.env = env
        return env

    async def kernel_env(self, env: dict, unset: list) -> None:
        """Set (and unset) environment variables in the agent (so commands
        and a restarted kernel get them) and in the running kernel."""
        os.environ.update(env)
        for k in unset:
            os.environ.pop(k, None)
        await self.ready.wait()
        code = ("import os as _sg_os\n"
                f"_sg_os.environ.update({json.dumps(env)})\n"
                f"for _sg_k in {json.dumps(unset)}: _sg_os.environ.pop(_sg_k, None)\n"
                "del _sg_os" + (", _sg_k" if unset else ""))
        reply = await self.own_request("execute_request", {"code": code, "silent": True, "store_history": False}, 30)
        if reply.get("status") != "ok":
            raise RuntimeError(f"could not set the kernel's environment: {reply.get('ename')}: {reply.get('evalue')}")

    async def op_egress(self, a, _):
        env = await self.set_egress(a)
        return {"port": self.egress.port if self.egress.server else None, "env": env}, b""

    async def op_quiesce(self, a, _):
        """Before a checkpoint: no TCP socket of the agent's may be in it."""
        closed = await self.egress.close("the sandbox is being checkpointed")
        return {"closed": closed}, b""

    async def op_setup(self, a, _):
        await self.setup(a)
        return {}, b""

    async def setup(self, a: P.SetupArgs) -> None:
        """Make a sandbox restored from a shared checkpoint its own: its
        environment, fresh randomness (every copy of a checkpoint would
        otherwise draw the same 'random' numbers), and a session id of its
        own for the kernel's messages (every copy had the checkpoint's)."""
        os.environ.update(a.env)
        reseed_kernel_random(self.restored_at, json.dumps(a.env).encode(), host_entropy(a.entropy))
        self.kernel.session.session = str(uuid.uuid4())
        code = ["import os as _sg_os, random as _sg_random",
                f"_sg_os.environ.update({json.dumps(a.env)})",
                "_sg_random.seed(_sg_os.urandom(32))",
                "_sg_k = getattr(get_ipython(), 'kernel', None)",
                f"if _sg_k is not None: _sg_k.session.session = {json.dumps(str(uuid.uuid4()))}"]
        if a.reseed_numpy:
            code.append("import sys as _sg_sys\nif 'numpy' in _sg_sys.modules: _sg_sys.modules['numpy'].random.seed()")
        code.append("del _sg_os, _sg_random, _sg_k" + (", _sg_sys" if a.reseed_numpy else ""))
        reply = await self.own_request("execute_request", {"code": "\n".join(code), "silent": True,
                                                           "store_history": False}, 30)
        if reply.get("status") != "ok":
            raise RuntimeError(f"setup failed in the kernel: {reply.get('ename')}: {reply.get('evalue')}")

    async def op_sync(self, a, _):
        await asyncio.get_running_loop().run_in_executor(None, os.sync)
        return {}, b""

    async def op_interrupt(self, a, _):
        self.kernel.interrupt()
        return {}, b""

    async def op_restart(self, a, _):
        self.restarting = True
        self.ready.clear()
        try:
            await self.kernel.kill()
            info = await self.start_kernel()
        finally:
            self.restarting = False
        return info, b""

    # File operations run synchronously on the event loop's thread: see
    # Workspace.acting_as_user for why they must.
    async def op_file_read(self, a, _):
        data, st = self.files.run(self.files.read_file, a.path, a.offset, a.length)
        if not a.length:
            return {"size": len(data)}, data
        return {"size": len(data), "total": st.st_size, "file": f"{st.st_ino}:{st.st_mtime_ns}"}, data

    async def op_file_write(self, a, payload):
        self.files.run(self.files.write_file, a.path, payload, a.mode)
        return {"size": len(payload)}, b""

    async def op_file_write_part(self, a, payload):
        if a.abort:
            self.files.run(self.files.abort_part, a.path, a.upload)
            return {}, b""
        size = self.files.run(self.files.write_part, a.path, a.upload, a.offset, payload, a.last, a.mode)
        return {"size": size}, b""

    async def op_file_list(self, a, _):
        return {"entries": self.files.run(self.files.list_dir, a.path)}, b""

    async def op_file_delete(self, a, _):
        self.files.run(self.files.delete, a.path)
        return {}, b""

    async def op_exec(self, a, _):
        # The working directory is walked like any file path, and the child
        # changes into the very directory that was checked, through the
        # descriptor (its chdir runs before it drops to the user).
        cwd = self.files.run(self.files.directory, a.cwd)
        try:
            proc = await asyncio.create_subprocess_exec(
                *a.argv, cwd=f"/proc/self/fd/{cwd}", stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
                **as_user(self.user))
        finally:
            os.close(cwd)
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(), a.timeout)
        except asyncio.TimeoutError:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = await proc.communicate()
        cap = P.MAX_PAYLOAD // 2 - 4096  # both streams must fit one frame
        truncated = len(out) > cap or len(err) > cap
        out, err = out[:cap], err[:cap]
        return {"exit_code": proc.returncode, "timed_out": timed_out, "stdout_len": len(out),
                "truncated": truncated}, out + err


class ShellFastPath:
    """Shell requests from the gateway written to the kernel's pipe by the
    stdin thread itself. Handing each to the event loop costs a self-pipe
    write, an epoll wake-up and a GIL hand-off: ~1 ms of a cell's round trip
    in a gVisor sandbox (docs/performance.md).

    A frame goes straight to the kernel only when it is a shell message of at
    most SMALL bytes, the kernel is ready and on its pipe, the pipe's queue is
    not full, and no shell frame handed to the loop earlier is still unsent
    (so shell requests keep their order). Writing never blocks this thread
    (KP.AgentEnd queues what the kernel has not read yet), so it always goes
    back to reading the stream. Everything else goes to the loop as before, in stream order; a
    frame that is not whole yet waits here unless it goes to the loop, which
    gets its bytes as they come (a file write is never held twice). After
    anything that does not parse, the rest of the stream goes to the loop,
    which ends the connection as it would have."""

    SMALL = 1 << 20

    def __init__(self, agent: "Agent"):
        self.agent = agent
        self.buf = bytearray()
        self.forward_left = 0  # bytes of a frame going to the loop still to come
        self.passthrough = False
        self.handed = 0  # shell frames handed to the loop, not yet sent by it
        self.out: list[bytes] = []  # what take() has for the loop so far
        self.count_lock = threading.Lock()

    def hand_one(self) -> None:
        """A shell frame goes to the loop (counted before the loop can see it)."""
        with self.count_lock:
            self.handed += 1

    def sent_one(self) -> None:
        with self.count_lock:
            self.handed -= 1

    def take(self, data: bytes, read_at: float) -> bytes:
        """Of what the stdin thread read, the bytes the event loop must see."""
        if self.passthrough:
            return data
        self.out = out = []
        if self.forward_left:
            n = min(self.forward_left, len(data))
            out.append(data[:n])
            self.forward_left -= n
            data = data[n:]
        self.buf += data
        buf = self.buf
        while len(buf) >= P.PREFIX.size:
            hlen, plen = P.PREFIX.unpack_from(buf)
            start = P.PREFIX.size + hlen
            if hlen > P.MAX_HEADER or plen > P.MAX_PAYLOAD:
                self.passthrough = True
                break
            if len(buf) < start:
                break
            try:
                frame = P.parse_header(bytes(buf[P.PREFIX.size:start]))
            except P.ProtocolError:
                self.passthrough = True
                break
            end = start + plen
            shell = isinstance(frame, P.KernelFrame) and frame.channel == "shell"
            if shell and plen <= self.SMALL:
                if len(buf) < end:
                    break
                if not self.direct(frame, bytes(buf[start:end]), read_at):
                    self.hand_one()
                    out.append(bytes(buf[:end]))
                del buf[:end]
                continue
            if shell:
                self.hand_one()
            n = min(end, len(buf))
            out.append(bytes(buf[:n]))
            del buf[:n]
            self.forward_left = end - n
            if self.forward_left:
                break
        if self.passthrough:
            out.append(bytes(buf))
            buf.clear()
        self.out = []
        return b"".join(out)

    def give_up(self) -> bytes:
        """After a failure inside take: what it had not yet handed on, and
        the loop sees everything from now on."""
        self.passthrough = True
        rest = b"".join(self.out) + bytes(self.buf)
        self.out, self.buf = [], bytearray()
        return rest

    def direct(self, frame: P.KernelFrame, payload: bytes, read_at: float) -> bool:
        """Whether the frame went to the kernel; if not, the loop sends it."""
        a, k = self.agent, self.agent.kernel
        pipe = k.pipe
        if not (a.ready.is_set() and k.on_pipe and pipe is not None and not pipe.full and not self.handed):
            return False
        try:
            parts = P.split_parts(frame, payload)
        except P.ProtocolError:
            return False  # the loop says so and ends the connection
        TRACE.on = frame.trace is not None
        stamps = a.trace_in(frame, parts, read_at) if TRACE.on else None
        try:
            pipe.write(k.pipe_frame(k.session.sign(parts[:4]), parts))
        except OSError:  # a kernel restarting under it: the loop sends it once one is ready
            return False
        if stamps is not None:
            stamps["ag_zmq"] = time.time()
        return True


class BlockingWriter:
    """Blocking writes to a pipe, with the StreamWriter calls Outbox uses.

    Used for stdio instead of asyncio's pipe transports: a gVisor sandbox
    restored from a checkpoint gets new host pipes, and this runsc does not
    re-arm readiness notifications for them, so an epoll-driven stream
    stalls after the first read. Plain blocking reads and writes work."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, True)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        os.close(self.fd)


async def stdio_streams(fast: ShellFastPath | None = None):
    loop = asyncio.get_running_loop()
    # Keep the real stdout for frames only; anything else printed goes to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    reader = asyncio.StreamReader(limit=P.MAX_PAYLOAD)
    os.set_blocking(0, True)

    def pump_stdin() -> None:  # see BlockingWriter for why this is a thread
        while True:
            try:
                data = os.read(0, 1 << 20)
            except OSError:
                data = b""
            if not data:
                loop.call_soon_threadsafe(reader.feed_eof)
                return
            read_at = time.time()
            if TRACE.on:
                TRACE.read_at = read_at
            if fast is not None:
                try:
                    data = fast.take(data, read_at)
                except Exception as e:  # never lose the stream over the fast path
                    log(f"shell fast path failed, handing the stream to the loop: {type(e).__name__}: {e}")
                    data = fast.give_up()
                if not data:
                    continue
            loop.call_soon_threadsafe(reader.feed_data, data)

    threading.Thread(target=pump_stdin, name="stdin", daemon=True).start()
    return reader, BlockingWriter(out_fd)


class ResetIsEnd(asyncio.StreamReaderProtocol):
    """A gateway that closes its socket with our frames still unread resets
    the stream (unix and vsock sockets do). What it wrote before the close
    still counts: asyncio would raise the reset ahead of the bytes it has
    buffered, losing a request the gateway sent last, so the reset ends the
    stream the way an end of file does, after those bytes."""

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(None if isinstance(exc, ConnectionResetError) else exc)


async def main_async(args: argparse.Namespace) -> None:
    try:  # as the init of any Linux would: code inside may use loopback (and egress does)
        loopback_up()
    except OSError as e:
        log(f"cannot bring the loopback interface up: {e}")
    agent = Agent(args)
    info = await agent.start_kernel()
    ready = P.encode(P.EventFrame(event="ready", data=info))
    kind, _, where = args.transport.partition(":")
    if kind == "stdio":
        agent.fast = ShellFastPath(agent)
        reader, writer = await stdio_streams(agent.fast)
        writer.write(ready)
        why = await agent.serve(reader, writer)
        log(f"{why}; stopping")
        await agent.kernel.kill()
        return
    if kind == "serial":  # the device persists; reopen after each hangup (a restore, a new gateway process)
        loop = asyncio.get_running_loop()
        while True:
            try:
                fd = os.open(where, os.O_RDWR | os.O_NOCTTY)
            except OSError as e:  # the agent is the VM's init: an exception here would panic the guest
                log(f"cannot open {where}: {e}; retrying")
                await asyncio.sleep(0.2)
                continue
            reader = asyncio.StreamReader(limit=P.MAX_PAYLOAD)
            rt, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
            t, proto = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(os.dup(fd), "wb", 0))
            writer = asyncio.StreamWriter(t, proto, reader, loop)
            writer.write(ready)
            await agent.serve(reader, writer)
            # Both descriptors closed: the port takes one opener at a time (EBUSY otherwise).
            writer.close()
            rt.close()
            await asyncio.sleep(0.2)

    async def on_connect(reader, writer):
        writer.write(ready)
        await agent.serve(reader, writer)
        writer.close()

    loop = asyncio.get_running_loop()

    def protocol():
        return ResetIsEnd(asyncio.StreamReader(limit=P.MAX_PAYLOAD), on_connect)

    if kind == "unix":
        server = await loop.create_unix_server(protocol, path=where)
    elif kind == "vsock":
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        sock.bind((socket.VMADDR_CID_ANY, int(where)))
        server = await loop.create_server(protocol, sock=sock)
    else:
        raise SystemExit(f"unknown transport {args.transport!r}")
    async with server:
        await server.serve_forever()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="sandgate-agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="stdio", help="stdio | unix:PATH | vsock:PORT | serial:DEVICE")
    ap.add_argument("--workspace", default="/workspace")
    ap.add_argument("--runtime-dir", default="/tmp/sandgate")
    ap.add_argument("--buffer-frames", type=int, default=10000)
    ap.add_argument("--buffer-bytes", type=int, default=64 << 20)
    ap.add_argument("--user", type=int, default=None, help="uid (and gid) for the kernel and commands")
    ap.add_argument("--kernel-cmd", nargs="+", default=None, help="kernel argv; '-f CONNECTION_FILE' is appended")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are for the kernel
    no_new_privileges()
    if args.user is not None and os.getpid() == 1:  # the sandbox's init: never a host's /proc
        hide_processes()
    try:
        asyncio.run(main_async(args))
    except RuntimeError as e:
        log(f"fatal: {e}")
        sys.exit(3)


if __name__ == "__main__":
    main()

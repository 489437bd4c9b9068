"""The kernel process the agent starts, and how its messages are signed."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import json
import os
import signal
import sys
import uuid

import zmq
import zmq.asyncio

from typing import TYPE_CHECKING

try:
    from . import kernel_pipe as KP
    from .diagnostics import log
    from .privileges import as_user
except ImportError:  # run as a script
    import kernel_pipe as KP  # type: ignore
    from diagnostics import log  # type: ignore
    from privileges import as_user  # type: ignore

if TYPE_CHECKING:
    from .spawner import Spawner


DELIM = b"<IDS|MSG>"
IPC_PORTS = {"shell": 1, "iopub": 2, "stdin": 3, "control": 4, "hb": 5}


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

    def __init__(self, runtime_dir: str, workspace: str, argv: list[str] | None, user: int | None = None,
                 spawner: Spawner | None = None):
        self.user = user
        self.spawner = spawner  # with one, the kernel runs in its PID namespace (spawner.py)
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
            if self.spawner is not None:
                null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
                try:
                    self.proc = await self.spawner.spawn(
                        [*argv, "-f", self.conn_file], cwd=self.workspace, env=env or dict(os.environ),
                        fds={0: null, 1: null, 2: sys.stderr.fileno(), **{fd: fd for fd in fds}}, user=self.user)
                finally:
                    os.close(null)
            else:
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

"""The guest agent: runs inside a sandbox, owns its kernel, speaks one stream.

It starts ipykernel (ipc transport), connects the four Jupyter channels, and
bridges them, plus file and command requests, to the gateway over a single
framed stream (see protocol.py). The agent, not the gateway, holds the
kernel: if the stream goes away the kernel keeps running and its messages are
buffered up to a bound; a reconnecting gateway gets them back, and a count of
whatever was dropped past the bound.

This module is the dispatch (``Agent``: the kernel's messages both ways, the
gateway's requests) and the entry point; each concern it calls on has a
module of its own: ``kernel_process`` (the kernel and its sockets),
``files`` (the workspace files API), ``outbox`` (buffering), ``egress``,
``privileges``, ``system``, ``fast_path`` and ``transports``. Needs only the
Python standard library, pyzmq, ipykernel and pydantic.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import socket
import sys
import time
import uuid
from typing import TYPE_CHECKING

try:
    from . import kernel_pipe as KP
    from . import protocol as P
    from . import transports
    from .diagnostics import TRACE, log
    from .egress import Egress
    from .files import WorkspaceFiles
    from .kernel_process import DELIM, KernelProcess
    from .outbox import Outbox
    from .privileges import as_user, hide_processes, no_new_privileges
    from .spawner import Spawner
    from .system import host_entropy, loopback_up, reseed_kernel_random
except ImportError:  # run as a script
    import kernel_pipe as KP  # type: ignore
    import protocol as P  # type: ignore
    import transports  # type: ignore
    from diagnostics import TRACE, log  # type: ignore
    from egress import Egress  # type: ignore
    from files import WorkspaceFiles  # type: ignore
    from kernel_process import DELIM, KernelProcess  # type: ignore
    from outbox import Outbox  # type: ignore
    from privileges import as_user, hide_processes, no_new_privileges  # type: ignore
    from spawner import Spawner  # type: ignore
    from system import host_entropy, loopback_up, reseed_kernel_random  # type: ignore

if TYPE_CHECKING:
    from .fast_path import ShellFastPath

OWN = b"sandgate-agent-"  # msg_id prefix of the agent's own kernel requests


class Agent:
    def __init__(self, args: argparse.Namespace, spawner: Spawner | None = None):
        self.spawner = spawner
        self.workspace = os.path.realpath(args.workspace)
        os.makedirs(self.workspace, exist_ok=True)
        self.out = Outbox(args.buffer_frames, args.buffer_bytes)
        self.user = args.user
        self.files = WorkspaceFiles(self.workspace, args.user)
        self.kernel = KernelProcess(args.runtime_dir, self.workspace, args.kernel_cmd, args.user, spawner)
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
    # WorkspaceFiles.acting_as_user for why they must.
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
            if self.spawner is not None:
                return self._exec_answer(*await self.spawner.run(list(a.argv), cwd_fd=cwd, env=dict(os.environ),
                                                                 user=self.user, timeout=a.timeout))
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
        return self._exec_answer(proc.returncode, timed_out, out, err)

    @staticmethod
    def _exec_answer(code: int, timed_out: bool, out: bytes, err: bytes):
        cap = P.MAX_PAYLOAD // 2 - 4096  # both streams must fit one frame
        truncated = len(out) > cap or len(err) > cap
        out, err = out[:cap], err[:cap]
        return {"exit_code": code, "timed_out": timed_out, "stdout_len": len(out),
                "truncated": truncated}, out + err


async def main_async(args: argparse.Namespace, spawner: Spawner | None = None) -> None:
    try:  # as the init of any Linux would: code inside may use loopback (and egress does)
        loopback_up()
    except OSError as e:
        log(f"cannot bring the loopback interface up: {e}")
    agent = Agent(args, spawner)
    if spawner is not None:
        spawner.start()
    info = await agent.start_kernel()
    await transports.serve(agent, args.transport, P.encode(P.EventFrame(event="ready", data=info)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="sandgate-agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="stdio", help="stdio | unix:PATH | vsock:PORT | serial:DEVICE")
    ap.add_argument("--workspace", default="/workspace")
    ap.add_argument("--runtime-dir", default="/tmp/sandgate")
    ap.add_argument("--buffer-frames", type=int, default=10000)
    ap.add_argument("--buffer-bytes", type=int, default=64 << 20)
    ap.add_argument("--user", type=int, default=None, help="uid (and gid) for the kernel and commands")
    ap.add_argument("--kernel-cmd", nargs="+", default=None, help="kernel argv; '-f CONNECTION_FILE' is appended")
    ap.add_argument("--pid-namespace", action="store_true",
                    help="as the sandbox's init: the kernel and commands in a PID namespace (and /proc) of their own, "
                         "where /proc has no hidepid (gVisor); needs CAP_SYS_ADMIN")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are for the kernel
    no_new_privileges()
    spawner = None
    if args.user is not None and os.getpid() == 1:  # the sandbox's init: never a host's /proc
        if not args.pid_namespace:
            hide_processes()
        else:
            try:  # before any thread: the spawner is forked, and must be single-threaded
                spawner = Spawner.fork()
            except OSError as e:  # a sandbox whose kernel could see the agent, or make namespaces, does not start
                log(f"fatal: cannot give the kernel a PID namespace of its own: {e}")
                sys.exit(3)
    try:
        asyncio.run(main_async(args, spawner))
    except RuntimeError as e:
        log(f"fatal: {e}")
        sys.exit(3)


if __name__ == "__main__":
    main()

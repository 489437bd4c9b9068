"""A fake sandbox driver, for fast in-process tests of the gateway core.

``FakeDriver`` implements sandgate.drivers.base.Driver; a ``FakeSandbox``'s stream is one end
of a socketpair, and a ``FakeAgent`` task on the other end speaks the real framed protocol
(sandgate_agent.protocol), so AgentLink and the core above it cannot tell it from a sandbox.

Faked: the agent (``ready`` on a cold create; a restored one sends nothing and runs no kernel
message until ``reconnect``; ops ping, reconnect, setup, sync, interrupt, restart and the
file ops on spec.workspace; ``kernel_died``/``kernel_restarted`` by ``sandbox.kill_kernel()``),
and ipykernel: shell messages one at a time in arrival order; a cell is Python run by exec()
in a namespace dict, answered like ipykernel (status busy, execute_input, stream stdout for
print(), execute_result for a final expression, error, execute_reply, status idle);
kernel_info_request and a few others get minimal replies. ``ENV`` (also ``os_environ``) in the
namespace is the sandbox's environment, which ``setup`` updates. Leading directive lines make a
cell wait, and ``interrupt`` raises KeyboardInterrupt there: ``#block NAME`` waits for
``driver.cell_gates[NAME]`` (``driver.at_gate[NAME]`` is set on arrival), ``#sleep SECONDS``.
A checkpoint freezes the sandbox, pickles the namespace's picklable values, execution count,
env and the kernel messages not yet answered (a cell waiting at its directives resumes there)
into image_dir/state.pkl, and stops it. Frozen, the agent reads and sends nothing.

Knobs, per driver: ``delays[op]`` (seconds) and ``gates[op]`` (an asyncio.Event) are awaited
inside op (create, restore, checkpoint, freeze, thaw, and a sandbox's destroy), ``entered[op]`` is
set on entry; ``fail[op] = reason`` raises SandboxError(reason) once (a failed checkpoint leaves the
sandbox running; ``fail["checkpoint_after_stop"]`` stops it first; ``fail["checkpoint_and_die"]``
fails it and has the sandbox die just after the error, as a runsc whose Sentry crashed does).
The agent has no ``egress`` op: asking for one fails. Counters ``created``, ``restored``;
``live``: the sandboxes not yet destroyed. ``sandbox.crash(reason)``: exit 137, failure() says why.

Not faked: processes, isolation, limits; unpicklable state across a checkpoint (functions,
classes, modules are dropped); interrupting plain code (it runs at once); stdin; comms;
ipykernel aborting queued cells after an error; a kernel exiting on shutdown_request; the
agent's outbox and ``dropped``; ``exec`` (answers an error); numpy reseeding.
"""

from __future__ import annotations

import ast
import asyncio
import collections
import datetime
import functools
import io
import itertools
import json
import os
import pickle
import shutil
import socket
import stat
import sys
import traceback
import uuid
from pathlib import Path
from typing import Dict, Optional, Tuple

from sandgate.drivers.base import Driver, Sandbox, SandboxError, SandboxSpec
from sandgate_agent import protocol as P

LANGUAGE_INFO = {"name": "python", "version": sys.version.split()[0], "mimetype": "text/x-python",
                 "file_extension": ".py", "nbconvert_exporter": "python", "pygments_lexer": "ipython3"}
KERNEL_INFO = {"status": "ok", "protocol_version": "5.3", "implementation": "sandgate-fake",
               "implementation_version": "0", "language_info": LANGUAGE_INFO,
               "banner": "sandgate fake kernel", "help_links": []}
SIMPLE_REPLIES = {  # others get busy/idle and no reply, like ipykernel
    "kernel_info_request": KERNEL_INFO, "is_complete_request": {"status": "complete"},
    "comm_info_request": {"status": "ok", "comms": {}}, "history_request": {"status": "ok", "history": []},
    "complete_request": {"status": "ok", "matches": [], "cursor_start": 0, "cursor_end": 0, "metadata": {}},
    "inspect_request": {"status": "ok", "found": False, "data": {}, "metadata": {}}}
HELPERS = {"ENV", "os_environ", "print"}  # names the fake puts into a namespace; never checkpointed
_pids = itertools.count(1000)


def _json(d) -> bytes:
    return json.dumps(d, default=str).encode()


def _picklable(v) -> bool:
    try:
        pickle.dumps(v)
        return True
    except Exception:
        return False


class FakeAgent:
    """The agent and its kernel: one task reading the stream, one running kernel messages."""

    def __init__(self, sandbox: "FakeSandbox", reader, writer, state: Optional[dict]):
        self.sandbox, self.driver, self.reader, self.writer = sandbox, sandbox.driver, reader, writer
        self.thawed, self.ready, self.wake = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.thawed.set()
        self.session, self.pid, self.tasks = uuid.uuid4().hex, next(_pids), set()
        st = state or {}
        self.env: Dict[str, str] = dict(st.get("env", sandbox.spec.env))
        self.count: int = st.get("execution_count", 0)
        self.ns = {**st.get("namespace", {}), "ENV": self.env, "os_environ": self.env}
        self.current: Optional[Tuple[str, list, bool]] = st.get("inflight")  # (channel, parts, output started)
        self.inbox: collections.deque = collections.deque(st.get("inbox", []))
        self.waiting: Optional[asyncio.Future] = None  # a cell's directives, while it waits at them
        self.interrupted = False
        self.setups = self.setups_on_reconnect = 0  # `setup` requests answered; setups done in `reconnect`
        self.spawn(self.serve())
        self.kernel = self.spawn(self.run_kernel())
        if state is None:
            self.ready.set()
            self.event("ready", {"pid": self.pid, "language_info": LANGUAGE_INFO})

    def spawn(self, coro) -> asyncio.Future:
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        self.writer.close()

    # -- output ------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    def event(self, name: str, data: dict) -> None:
        self.write(P.encode(P.EventFrame(event=name, data=data)))

    def send(self, channel: str, msg_type: str, content: dict, parent: dict) -> None:
        header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "fake",
                  "session": parent.get("session", self.session),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "5.3"}
        self.write(P.encode_kernel(channel, [_json(header), _json(parent), b"{}", _json(content)]))

    def status(self, state: str, parent: dict) -> None:
        self.send("iopub", "status", {"execution_state": state}, parent)

    # -- the stream --------------------------------------------------------
    async def serve(self) -> None:
        why = "the gateway closed the stream"
        try:
            while True:
                frame, payload = await P.read_frame(self.reader)
                await self.thawed.wait()  # a frozen agent reads nothing: the frame stays "in the pipe"
                if isinstance(frame, P.KernelFrame):
                    parts = P.split_parts(frame, payload)
                    if frame.channel == "shell":
                        self.inbox.append(("shell", parts))
                        self.wake.set()
                    elif frame.channel == "control":  # ipykernel answers control beside a running cell
                        self.spawn(self.control(parts))
                elif isinstance(frame, P.RequestFrame):
                    self.spawn(self.answer(frame, payload))
        except EOFError:
            pass
        except (P.ProtocolError, ConnectionError, OSError) as e:
            why = f"agent dropped the stream: {e}"
        self.sandbox.stop(0, why)  # like the stdio agent: the stream ends, the sandbox stops

    async def answer(self, req: P.RequestFrame, payload: bytes) -> None:
        data = b""
        try:
            model = P.OP_ARGS.get(req.op)
            if model is None:
                raise ValueError(f"unknown op {req.op!r}")
            result, data = await getattr(self, "op_" + req.op)(model(**req.args), payload)
            resp = P.ResponseFrame(id=req.id, result=result)
        except Exception as e:
            resp, data = P.ResponseFrame(id=req.id, ok=False, error=f"{type(e).__name__}: {e}"), b""
        await self.thawed.wait()
        self.write(P.encode(resp, data))

    # -- the kernel --------------------------------------------------------
    async def run_kernel(self) -> None:
        await self.ready.wait()
        while True:
            if self.current is None:
                while not self.inbox:
                    self.wake.clear()
                    await self.wake.wait()
                self.current = (*self.inbox.popleft(), False)
            await self.thawed.wait()
            await self.handle(*self.current)
            self.current = None

    async def control(self, parts: list) -> None:
        await self.ready.wait()
        await self.thawed.wait()
        await self.handle("control", parts, False)

    async def handle(self, channel: str, parts: list, started: bool) -> None:
        header, content = json.loads(parts[0]), json.loads(parts[3])
        mtype = header.get("msg_type", "")
        if mtype == "execute_request":
            return await self.execute(channel, parts, header, content, started)
        self.status("busy", header)
        reply = SIMPLE_REPLIES.get(mtype)
        if mtype == "shutdown_request":
            reply = {"status": "ok", "restart": bool(content.get("restart"))}
        elif mtype == "interrupt_request":
            self.interrupt()
            reply = {"status": "ok"}
        if reply is not None:
            self.send(channel, mtype[:-len("request")] + "reply", reply, header)
        self.status("idle", header)

    async def execute(self, channel: str, parts: list, header: dict, content: dict, started: bool) -> None:
        code, silent = content.get("code", ""), bool(content.get("silent", False))
        if not started:
            self.status("busy", header)
            if content.get("store_history", True) and not silent:
                self.count += 1
            if not silent:
                self.send("iopub", "execute_input", {"code": code, "execution_count": self.count}, header)
            if channel == "shell":
                self.current = (channel, parts, True)
        n, out, result, err = self.count, io.StringIO(), None, None
        try:
            self.interrupted = False
            self.waiting = asyncio.ensure_future(self.directives(code))
            try:
                await self.waiting
            except asyncio.CancelledError:
                if not self.interrupted:
                    raise
                raise KeyboardInterrupt from None
            finally:
                self.waiting = None
            await self.thawed.wait()
            self.ns["print"] = functools.partial(print, file=out)  # a call's own file= still wins
            result = self.run(code)
        except (Exception, KeyboardInterrupt) as e:
            err = {"ename": type(e).__name__, "evalue": str(e),
                   "traceback": traceback.format_exception(type(e), e, e.__traceback__)}
        if out.getvalue():
            self.send("iopub", "stream", {"name": "stdout", "text": out.getvalue()}, header)
        if err:
            self.send("iopub", "error", err, header)
            reply = {"status": "error", "execution_count": n, **err}
        else:
            if result is not None and not silent:
                self.send("iopub", "execute_result", {"execution_count": n, "data": {"text/plain": repr(result)},
                                                      "metadata": {}}, header)
            reply = {"status": "ok", "execution_count": n, "user_expressions": {}, "payload": []}
        self.send(channel, "execute_reply", reply, header)
        self.status("idle", header)

    async def directives(self, code: str) -> None:
        for line in code.splitlines():
            word, _, arg = line.strip().partition(" ")
            if word == "#block":
                self.driver.at_gate[arg.strip()].set()
                await self.driver.cell_gates[arg.strip()].wait()
            elif word == "#sleep":
                await asyncio.sleep(float(arg))
            elif line.strip():
                return

    def run(self, code: str):
        """Like ipykernel: a final expression statement is the cell's value."""
        tree = ast.parse(code, "<cell>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), self.ns)
        return eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.ns) if last else None

    def interrupt(self) -> None:
        if self.waiting and not self.waiting.done():
            self.interrupted = True
            self.waiting.cancel()

    def new_kernel(self) -> None:
        """A fresh kernel process: empty namespace and queue, count 0; the environment stays."""
        self.kernel.cancel()
        self.ns = {"ENV": self.env, "os_environ": self.env}
        self.count, self.current, self.pid = 0, None, next(_pids)
        self.inbox.clear()
        self.kernel = self.spawn(self.run_kernel())

    def kill_kernel(self, exit_code: int = 1, final: bool = False) -> None:
        self.kernel.cancel()
        self.event("kernel_died", {"exit_code": exit_code})
        if final:
            self.ready.clear()
            return self.event("kernel_died", {"exit_code": exit_code, "final": True, "reason": "kernel died (fake)"})
        self.new_kernel()
        self.event("kernel_restarted", {"pid": self.pid, "language_info": LANGUAGE_INFO})

    def snapshot(self) -> bytes:
        ns = {k: v for k, v in self.ns.items() if k not in HELPERS and not k.startswith("__") and _picklable(v)}
        return pickle.dumps({"namespace": ns, "execution_count": self.count, "env": self.env,
                             "inflight": self.current, "inbox": list(self.inbox)})

    # -- ops -------------------------------------------------------------
    async def op_ping(self, a, _):
        return {"kernel_alive": not self.kernel.done(), "kernel_responding": self.ready.is_set(), "pid": self.pid,
                "buffered": 0, "agent_version": P.VERSION}, b""

    async def op_reconnect(self, a, _):
        # Unless the driver says otherwise, as an agent from before `setup`
        # rode on `reconnect`: no "setup" in the reply, so the gateway sends
        # `setup` after it (its fallback).
        self.ready.set()
        if a.setup is None or not self.driver.setup_on_reconnect:
            return dict(KERNEL_INFO), b""
        if self.driver.fail_setup:
            return {**KERNEL_INFO, "setup": False, "setup_error": f"RuntimeError: {self.driver.fail_setup}"}, b""
        self.setups_on_reconnect += 1
        self.env.update(a.setup.env)
        return {**KERNEL_INFO, "setup": True}, b""

    async def op_setup(self, a, _):
        if self.driver.fail_setup:
            raise RuntimeError(self.driver.fail_setup)
        self.setups += 1
        self.env.update(a.env)
        return {}, b""

    async def op_sync(self, a, _):
        return {}, b""

    async def op_interrupt(self, a, _):
        self.interrupt()
        return {}, b""

    async def op_exec(self, a, _):
        raise NotImplementedError("the fake agent runs no commands")

    async def op_restart(self, a, _):
        self.new_kernel()
        self.status("starting", {})
        self.status("idle", {})
        return {"pid": self.pid, "language_info": LANGUAGE_INFO}, b""

    def resolve(self, path: str) -> str:
        root = os.path.realpath(self.sandbox.spec.workspace)  # read each time: the warm pool reassigns it
        full = os.path.realpath(os.path.join(root, path.lstrip("/")))
        if full != root and not full.startswith(root + os.sep):
            raise PermissionError(f"{path!r} is outside the workspace")
        return full

    async def op_file_read(self, a, _):
        data = Path(self.resolve(a.path)).read_bytes()
        return {"size": len(data)}, data

    async def op_file_write(self, a, payload):
        path = Path(self.resolve(a.path))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.sandgate-{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(payload)
        os.chmod(tmp, a.mode)
        os.replace(tmp, path)
        return {"size": len(payload)}, b""

    async def op_file_write_part(self, a, payload):
        path = Path(self.resolve(a.path))
        tmp = path.with_name(f"{path.name}.sandgate-{a.upload}")
        if a.abort:
            tmp.unlink(missing_ok=True)
            return {}, b""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb" if a.offset == 0 else "r+b") as f:
            f.seek(a.offset)
            f.write(payload)
        if a.last:
            os.chmod(tmp, a.mode)
            os.replace(tmp, path)
        return {"size": a.offset + len(payload)}, b""

    async def op_file_list(self, a, _):
        entries = []
        for e in sorted(os.scandir(self.resolve(a.path)), key=lambda e: e.name):
            st = e.stat(follow_symlinks=False)
            kind = "directory" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "file"
            entries.append({"name": e.name, "type": kind, "size": st.st_size, "mtime": st.st_mtime})
        return {"entries": entries}, b""

    async def op_file_delete(self, a, _):
        path = self.resolve(a.path)
        if path == os.path.realpath(self.sandbox.spec.workspace):
            raise PermissionError("refusing to delete the workspace itself")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return {}, b""


class FakeSandbox(Sandbox):
    def __init__(self, spec: SandboxSpec, driver: "FakeDriver"):
        super().__init__(spec)
        self.driver, self.agent, self.stopped = driver, None, asyncio.Event()
        self.exit_code: Optional[int] = None
        self.why = ""

    async def start(self, state: Optional[dict]) -> None:
        ours, theirs = socket.socketpair()
        self.reader, self.writer = await asyncio.open_connection(sock=ours, limit=P.MAX_PAYLOAD)
        agent_reader, agent_writer = await asyncio.open_connection(sock=theirs, limit=P.MAX_PAYLOAD)
        self.agent = FakeAgent(self, agent_reader, agent_writer, state)

    @property
    def running(self) -> bool:
        return self.exit_code is None

    async def wait(self) -> int:
        await self.stopped.wait()
        return self.exit_code

    def failure(self) -> str:
        return "running" if self.exit_code is None else f"{self.why} (exit status {self.exit_code})"

    def stop(self, code: int, why: str) -> None:
        if self.exit_code is not None:
            return
        self.exit_code, self.why = code, why
        if self.agent:
            self.agent.stop()
        self.stopped.set()

    def crash(self, reason: str = "the sandbox crashed") -> None:
        self.stop(137, reason)

    def kill_kernel(self, exit_code: int = 1, final: bool = False) -> None:
        """The kernel dies, the sandbox lives: kernel_died, then kernel_restarted (or a final kernel_died)."""
        self.agent.kill_kernel(exit_code, final)

    async def destroy(self) -> None:
        await self.driver._step("destroy")
        self.stop(137, "destroyed")
        if self.writer:
            self.writer.close()
        self.driver.live.discard(self)


class FakeDriver(Driver):
    name = "fake"
    can_checkpoint = True
    sync_before_checkpoint = False

    def __init__(self, root_dir: str = ""):
        self.delays: Dict[str, float] = {}
        self.gates: Dict[str, asyncio.Event] = {}
        self.fail: Dict[str, str] = {}
        event = lambda: collections.defaultdict(asyncio.Event)  # noqa: E731
        self.entered, self.cell_gates, self.at_gate = event(), event(), event()
        self.created = self.restored = 0
        self.live: set = set()
        self.setup_on_reconnect = False  # the agent does `setup` inside `reconnect` (as the real one)
        self.fail_setup: Optional[str] = None  # `setup` fails with this, either way

    @classmethod
    def probe(cls, settings=None) -> Tuple[bool, str]:
        return True, "in-process fake sandboxes, for tests"

    async def _step(self, op: str) -> None:
        self.entered[op].set()
        await asyncio.sleep(self.delays.get(op, 0))
        if op in self.gates:
            await self.gates[op].wait()
        if op in self.fail:
            raise SandboxError(self.fail.pop(op))

    async def _start(self, spec: SandboxSpec, state: Optional[dict]) -> FakeSandbox:
        sandbox = FakeSandbox(spec, self)
        await sandbox.start(state)
        self.live.add(sandbox)
        return sandbox

    @staticmethod
    def _alive(sandbox: Sandbox) -> FakeSandbox:
        if not isinstance(sandbox, FakeSandbox) or not sandbox.running:
            raise SandboxError(f"sandbox {sandbox.id} is not running")
        return sandbox

    async def create(self, spec: SandboxSpec) -> Sandbox:
        await self._step("create")
        Path(spec.workspace).mkdir(parents=True, exist_ok=True)
        self.created += 1
        return await self._start(spec, None)

    async def restore(self, spec: SandboxSpec, image_dir: Path, consume: bool = False) -> Sandbox:
        await self._step("restore")
        image = Path(image_dir) / "state.pkl"
        if not image.is_file():
            raise SandboxError(f"checkpoint image missing in {image_dir}")
        self.restored += 1
        return await self._start(spec, pickle.loads(image.read_bytes()))

    async def checkpoint(self, sandbox: Sandbox, image_dir: Path) -> None:
        agent = self._alive(sandbox).agent
        if "checkpoint_and_die" in self.fail:  # the error first, the sandbox's death a moment after
            why = self.fail.pop("checkpoint_and_die")
            asyncio.get_running_loop().call_soon(sandbox.crash, why)
            raise SandboxError(f"checkpoint failed: {why}")
        was_frozen = not agent.thawed.is_set()
        agent.thawed.clear()  # like runsc: the sandbox stops where it is, then is saved
        try:
            await self._step("checkpoint")
            self._alive(sandbox)
        except BaseException:
            if not was_frozen:
                agent.thawed.set()
            raise
        Path(image_dir).mkdir(parents=True, exist_ok=True)
        (Path(image_dir) / "state.pkl").write_bytes(agent.snapshot())
        sandbox.stop(0, "stopped by its checkpoint")
        if "checkpoint_after_stop" in self.fail:
            raise SandboxError(self.fail.pop("checkpoint_after_stop"))

    async def freeze(self, sandbox: Sandbox) -> None:
        await self._step("freeze")
        self._alive(sandbox).agent.thawed.clear()

    async def thaw(self, sandbox: Sandbox) -> None:
        await self._step("thaw")
        self._alive(sandbox).agent.thawed.set()

    async def reap(self, keep=()) -> int:
        return 0

"""The one place that maps kernel ids to live sandboxes and owns their lifecycle.

A kernel *is* a sandbox: starting a kernel creates a sandbox whose guest agent
runs ipykernel. This module routes kernel messages between the agent link and
the websocket connections attached to the kernel, keeps what arrives while
none is attached (replayed on reconnect), tracks activity and execution
state, restarts, interrupts, culls idle kernels and reports sandboxes that
died. It knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import logging
import shutil
import uuid
from typing import Dict, List, Optional, Protocol

from sandgate_agent import protocol as P
from sandgate_images import rootfs as images

from .agent_link import AgentError, AgentLink
from .config import Settings
from .drivers.base import Driver, Sandbox, SandboxError, SandboxSpec
from .kernelspecs import KernelSpecs
from .store.memory import MemoryStore

log = logging.getLogger("sandgate.sessions")


class NoSuchKernel(KeyError):
    pass


class LimitReached(Exception):
    pass


class Listener(Protocol):
    """A websocket connection attached to a kernel."""

    session_ids: set

    def deliver(self, channel: str, parts: List[bytes]) -> None: ...


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def iso(t: dt.datetime) -> str:
    # The exact form jupyter_server's GatewayClient parses: %Y-%m-%dT%H:%M:%S.%fZ
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def status_message(state: str, parent: Optional[dict] = None) -> List[bytes]:
    header = {"msg_id": uuid.uuid4().hex, "msg_type": "status", "username": "sandgate",
              "session": "sandgate", "date": iso(utcnow()), "version": "5.3"}
    return [json.dumps(header).encode(), json.dumps(parent or {}).encode(), b"{}",
            json.dumps({"execution_state": state}).encode()]


class Kernel:
    def __init__(self, manager: "KernelManager", kernel_id: str, name: str, driver: str, env: Dict[str, str]):
        self.manager = manager
        self.id, self.name, self.driver, self.env = kernel_id, name, driver, env
        self.sandbox: Optional[Sandbox] = None
        self.link: Optional[AgentLink] = None
        self.last_activity = utcnow()
        self.execution_state = "starting"
        self.failure: Optional[str] = None  # why the sandbox is dead, when it is
        self.listeners: List[Listener] = []
        self.replay: collections.deque = collections.deque()
        self.replay_dropped = 0
        self.pending: Dict[str, dict] = {}  # execute_request headers awaiting their reply
        self._watch: Optional[asyncio.Task] = None

    @property
    def workspace(self):
        return self.manager.settings.home / "workspaces" / self.id

    def model(self) -> dict:
        m = {"id": self.id, "name": self.name, "last_activity": iso(self.last_activity),
             "execution_state": self.execution_state, "connections": len(self.listeners),
             "driver": self.driver}
        if self.failure:
            m["reason"] = self.failure
        return m

    # -- sandbox lifecycle ---------------------------------------------
    async def boot(self) -> None:
        s = self.manager.settings
        spec = SandboxSpec(id=f"sg-{self.id}-{uuid.uuid4().hex[:6]}", rootfs=self.manager.rootfs(),
                           agent_dir=self.manager.agent_dir(), workspace=self.workspace,
                           state_dir=s.home / "sandboxes" / self.id, env=self.env, limits=s.limits)
        self.execution_state, self.failure = "starting", None
        sandbox = await self.manager.drivers[self.driver].create(spec)
        self.sandbox = sandbox
        self.link = AgentLink(sandbox.reader, sandbox.writer, self._on_kernel, self._on_event)
        exited = asyncio.ensure_future(sandbox.wait())
        done, _ = await asyncio.wait({self.link.ready, exited}, timeout=s.kernel_start_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if self.link.ready not in done or self.link.ready.exception():
            await asyncio.sleep(0.2)  # let the last log lines arrive
            why = sandbox.failure() if exited.done() else f"agent not ready within {s.kernel_start_timeout:g} s"
            exited.cancel()
            await self.teardown()
            raise SandboxError(f"kernel {self.id} failed to start: {why}")
        self.execution_state = "idle"
        self._watch = asyncio.ensure_future(self._watch_sandbox(exited))

    async def _watch_sandbox(self, exited: asyncio.Future) -> None:
        await exited
        await asyncio.sleep(0.2)
        self.failure = self.sandbox.failure() if self.sandbox else "sandbox gone"
        self.execution_state = "dead"
        log.error("kernel %s: %s", self.id, self.failure)
        self._broadcast("iopub", status_message("dead"))
        self._fail_pending(self.failure)
        if self.link:
            await self.link.close()

    async def teardown(self) -> None:
        if self._watch:
            self._watch.cancel()
            self._watch = None
        if self.link:
            await self.link.close()
            self.link = None
        if self.sandbox:
            await self.sandbox.destroy()
            self.sandbox = None

    # -- messages ----------------------------------------------------------
    def _on_kernel(self, channel: str, parts: List[bytes]) -> None:
        self.last_activity = utcnow()
        if channel == "shell" and self.pending and b"execute_reply" in parts[0]:
            try:
                self.pending.pop(json.loads(parts[1]).get("msg_id"), None)
            except ValueError:
                pass
        if channel == "iopub" and b'"status"' in parts[0]:
            try:
                state = json.loads(parts[3]).get("execution_state")
                if state and json.loads(parts[0]).get("msg_type") == "status":
                    self.execution_state = state
            except ValueError:
                pass
        if not self.listeners:
            self._keep(channel, parts)
            return
        targets = self.listeners
        if channel != "iopub" and len(self.listeners) > 1:
            # Replies go to the connection whose session asked; iopub to all.
            targets = self._askers(parts)
        for conn in targets:
            conn.deliver(channel, parts)

    def _keep(self, channel: str, parts: List[bytes]) -> None:
        if len(self.replay) >= self.manager.settings.replay_messages:
            self.replay_dropped += 1
            return
        self.replay.append((channel, parts))

    def _broadcast(self, channel: str, parts: List[bytes]) -> None:
        if not self.listeners:
            self._keep(channel, parts)
        for conn in self.listeners:
            conn.deliver(channel, parts)

    def _on_event(self, ev: P.EventFrame) -> None:
        if ev.event == "kernel_died":
            final = ev.data.get("final")
            log.warning("kernel %s: ipykernel exited with status %s%s", self.id, ev.data.get("exit_code"),
                        "; giving up: " + ev.data.get("reason", "") if final else "; restarting it")
            self.execution_state = "dead" if final else "restarting"
            if final:
                self.failure = ev.data.get("reason")
            self._broadcast("iopub", status_message(self.execution_state))
            self._fail_pending(f"ipykernel exited with status {ev.data.get('exit_code')}")
        elif ev.event == "kernel_restarted":
            log.info("kernel %s: ipykernel restarted after a crash", self.id)
            self.execution_state = "idle"
        elif ev.event == "dropped":
            log.warning("kernel %s: agent dropped %s messages while detached", self.id, ev.data.get("frames"))

    def _fail_pending(self, why: str) -> None:
        """Answer every execute_request the dead kernel never answered, so no
        client waits forever (Kernel Gateway leaves them hanging)."""
        pending, self.pending = self.pending, {}
        for header in pending.values():
            evalue = f"The kernel died while running this cell ({why}); its state is lost"
            reply = status_message("idle", header)
            reply[0] = reply[0].replace(b'"status"', b'"execute_reply"')
            reply[3] = json.dumps({"status": "error", "ename": "DeadKernelError", "evalue": evalue,
                                   "traceback": [f"DeadKernelError: {evalue}"], "execution_count": None}).encode()
            self._deliver_reply(reply)
            self._broadcast("iopub", status_message("idle", header))

    def _askers(self, parts: List[bytes]) -> List[Listener]:
        try:
            session = json.loads(parts[1]).get("session")
        except ValueError:
            session = None
        return [c for c in self.listeners if session in c.session_ids] or self.listeners

    def _deliver_reply(self, parts: List[bytes]) -> None:
        if not self.listeners:
            self._keep("shell", parts)
        for conn in self._askers(parts):
            conn.deliver("shell", parts)

    def attach(self, conn: Listener) -> None:
        self.listeners.append(conn)
        replay, self.replay = self.replay, collections.deque()
        if self.replay_dropped:
            log.warning("kernel %s: %d messages dropped while no client was connected", self.id, self.replay_dropped)
            self.replay_dropped = 0
        for channel, parts in replay:
            conn.deliver(channel, parts)

    def detach(self, conn: Listener) -> None:
        if conn in self.listeners:
            self.listeners.remove(conn)

    def send(self, channel: str, parts: List[bytes], header: dict) -> None:
        if self.execution_state == "dead" or not self.link:
            raise AgentError(f"kernel {self.id} is dead: {self.failure or 'no sandbox'}")
        self.last_activity = utcnow()
        if header.get("msg_type") == "execute_request":
            self.pending[header["msg_id"]] = header
        self.link.send_kernel(channel, parts)


class KernelManager:
    def __init__(self, settings: Settings, drivers: Dict[str, Driver], specs: KernelSpecs,
                 store: Optional[MemoryStore] = None):
        self.settings = settings
        self.drivers = drivers
        self.specs = specs
        self.store = store or MemoryStore()
        self.kernels: Dict[str, Kernel] = {}
        self._starting = 0
        self._rootfs = None
        self._agent_dir = None
        self._culler: Optional[asyncio.Task] = None

    def rootfs(self):
        if self._rootfs is None:
            if not images.is_built(self.settings.home):
                raise SandboxError("the sandbox image is not built: run `sandgate image build`")
            self._rootfs = images.image_dir(self.settings.home) / "rootfs"
        return self._rootfs

    def agent_dir(self):
        if self._agent_dir is None:
            self._agent_dir = images.agent_bundle(self.settings.home)
        return self._agent_dir

    def get(self, kernel_id: str) -> Kernel:
        try:
            return self.kernels[kernel_id]
        except KeyError:
            raise NoSuchKernel(kernel_id) from None

    def list(self) -> List[Kernel]:
        return list(self.kernels.values())

    def kernel_env(self, requested: Dict[str, str]) -> Dict[str, str]:
        """Only KERNEL_* and explicitly allowed names reach a sandbox."""
        allow = set(self.settings.env_allow)
        return {k: v for k, v in requested.items() if k.startswith("KERNEL_") or k in allow}

    async def start(self, name: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> Kernel:
        spec = self.specs.get(name or self.specs.default)  # KeyError for an unknown name
        if len(self.kernels) + self._starting >= self.settings.max_kernels:
            raise LimitReached(f"Maximum number of kernels ({self.settings.max_kernels}) reached")
        kernel = Kernel(self, str(uuid.uuid4()), spec.name, spec.driver, self.kernel_env(env or {}))
        self._starting += 1
        try:
            await kernel.boot()
        except BaseException:
            shutil.rmtree(kernel.workspace, ignore_errors=True)
            raise
        finally:
            self._starting -= 1
        self.kernels[kernel.id] = kernel
        await self.store.put(kernel.id, {"driver": kernel.driver, "sandbox": kernel.sandbox.id})
        log.info("kernel %s started (%s, sandbox %s)", kernel.id, kernel.driver, kernel.sandbox.id)
        return kernel

    async def shutdown(self, kernel_id: str) -> None:
        kernel = self.kernels.pop(kernel_id, None)
        if kernel is None:
            raise NoSuchKernel(kernel_id)
        await self.store.delete(kernel_id)
        await kernel.teardown()
        shutil.rmtree(kernel.workspace, ignore_errors=True)
        log.info("kernel %s shut down", kernel_id)

    async def interrupt(self, kernel_id: str) -> None:
        kernel = self.get(kernel_id)
        if not kernel.link or kernel.execution_state == "dead":
            raise AgentError(f"kernel {kernel_id} is dead: {kernel.failure}")
        await kernel.link.request("interrupt", timeout=10)

    async def restart(self, kernel_id: str) -> Kernel:
        """Restart ipykernel in its sandbox; a dead sandbox is created anew
        over the same workspace, so files survive either way."""
        kernel = self.get(kernel_id)
        if kernel.link and kernel.execution_state != "dead" and not kernel.link.closed.done():
            kernel.execution_state = "restarting"
            kernel._broadcast("iopub", status_message("restarting"))
            try:
                await kernel.link.request("restart", timeout=self.settings.kernel_start_timeout)
                kernel.execution_state = "idle"
                return kernel
            except AgentError as e:
                log.warning("kernel %s: in-sandbox restart failed (%s); recreating the sandbox", kernel_id, e)
        await kernel.teardown()
        await kernel.boot()
        return kernel

    async def shutdown_all(self) -> None:
        if self._culler:
            self._culler.cancel()
        await asyncio.gather(*(self.shutdown(k) for k in list(self.kernels)), return_exceptions=True)

    def start_culler(self) -> None:
        if self.settings.cull_idle_timeout > 0 and self._culler is None:
            self._culler = asyncio.ensure_future(self._cull_loop())

    async def _cull_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cull_interval)
            now = utcnow()
            for k in list(self.kernels.values()):
                idle = (now - k.last_activity).total_seconds()
                if not k.listeners and k.execution_state != "busy" and idle > self.settings.cull_idle_timeout:
                    log.info("culling kernel %s: idle %.0f s with no connection", k.id, idle)
                    try:
                        await self.shutdown(k.id)
                    except NoSuchKernel:
                        pass

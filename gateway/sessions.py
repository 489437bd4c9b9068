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
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Protocol

from sandgate_agent import protocol as P
from sandgate_images import rootfs as images

from .agent_link import AgentError, AgentLink
from .checkpoints import Checkpoint, CheckpointStore, dir_size
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


class Collector:
    """An internal listener: gathers one cell's output for the sandbox API."""

    def __init__(self, session: str):
        self.session_ids = {session}
        self.queue: asyncio.Queue = asyncio.Queue()

    def deliver(self, channel: str, parts: List[bytes]) -> None:
        self.queue.put_nowait((channel, parts))


def output_of(msg_type: str, content: dict) -> Optional[dict]:
    if msg_type == "stream":
        return {"type": "stream", "name": content.get("name"), "text": content.get("text", "")}
    if msg_type in ("execute_result", "display_data"):
        return {"type": msg_type, "data": content.get("data", {}), "metadata": content.get("metadata", {})}
    if msg_type == "error":
        return {"type": "error", "ename": content.get("ename"), "evalue": content.get("evalue"),
                "traceback": content.get("traceback", [])}
    return None


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
        self.replay_bytes = 0
        self.pending: Dict[str, dict] = {}  # execute_request headers awaiting their reply
        self.lock = asyncio.Lock()  # one of checkpoint, pause, resume, restart at a time
        self.head: Optional[str] = None  # newest checkpoint in this sandbox's line
        self.origin: Optional[str] = None  # the checkpoint this sandbox was forked from
        self.paused: Optional[Path] = None  # its running-state image while paused to disk
        self.frozen: Optional[str] = None  # while paused in memory: the execution state to return to
        self.held: List[tuple] = []  # client messages that arrived while paused
        self.created = utcnow()
        self.labels: Dict[str, str] = {}
        self.limits = manager.settings.limits
        self.expires: Optional[dt.datetime] = None
        self._watch: Optional[asyncio.Task] = None

    @property
    def workspace(self):
        return self.manager.settings.home / "workspaces" / self.id

    def model(self) -> dict:
        m = {"id": self.id, "name": self.name, "last_activity": iso(self.last_activity),
             "execution_state": self.execution_state, "connections": len(self.listeners),
             "driver": self.driver, "created": iso(self.created)}
        if self.expires:
            m["expires"] = iso(self.expires)
        if self.failure:
            m["reason"] = self.failure
        return m

    # -- sandbox lifecycle ---------------------------------------------
    def new_spec(self) -> SandboxSpec:
        s = self.manager.settings
        return SandboxSpec(id=f"sg-{self.id}-{uuid.uuid4().hex[:6]}", rootfs=self.manager.rootfs(),
                           agent_dir=self.manager.agent_dir(), workspace=self.workspace,
                           state_dir=s.home / "sandboxes" / self.id, env=self.env, limits=self.limits,
                           workspace_seed=self.manager.checkpoints.state_dir(self.head) if self.head else None)

    async def boot(self, restore_from: Optional[Path] = None, consume: bool = False) -> None:
        """Start the sandbox, cold or from a checkpoint image (``consume``: the
        image is removed after, see Driver.restore)."""
        s = self.manager.settings
        spec = self.new_spec()
        self.execution_state, self.failure = "starting", None
        driver = self.manager.drivers[self.driver]
        try:
            sandbox = await (driver.restore(spec, restore_from, consume) if restore_from else driver.create(spec))
        except BaseException as e:
            self.execution_state, self.failure = "dead", str(e) or type(e).__name__
            raise
        self.sandbox = sandbox
        self.link = AgentLink(sandbox.reader, sandbox.writer, self._on_kernel, self._on_event)
        exited = asyncio.ensure_future(sandbox.wait())
        # A restored agent said "ready" long ago; it is asked to reconnect instead.
        ready = asyncio.ensure_future(self.link.request("reconnect", {"clock": time.time()},
                                                        timeout=s.kernel_start_timeout)
                                      if restore_from else self.link.ready)
        done, _ = await asyncio.wait({ready, exited}, timeout=s.kernel_start_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ready not in done or ready.exception():
            await asyncio.sleep(0.2)  # let the last log lines arrive
            if exited.done():
                why = sandbox.failure()
            elif ready.done():
                why = str(ready.exception())
            else:
                why = f"agent not ready within {s.kernel_start_timeout:g} s ({sandbox.failure()})"
            ready.cancel()
            exited.cancel()
            await self.teardown()
            self.execution_state, self.failure = "dead", why
            raise SandboxError(f"kernel {self.id} failed to {'restore' if restore_from else 'start'}: {why}")
        self.execution_state = "idle"
        self._watch = asyncio.ensure_future(self._watch_sandbox(exited))
        self._send_held()

    def _send_held(self) -> None:
        """What clients sent while the sandbox was paused or being checkpointed."""
        held, self.held = self.held, []
        for channel, parts in held:
            self.link.send_kernel(channel, parts)

    async def _stop_into(self, image_dir: Path) -> None:
        """Checkpoint the running sandbox into ``image_dir``; it is stopped after.
        If the driver fails first, the sandbox keeps running untouched."""
        driver = self.manager.drivers[self.driver]
        if driver.sync_before_checkpoint and self.link:
            try:
                await self.link.request("sync", timeout=60)
            except AgentError as e:  # the memory image still holds what was not flushed
                log.warning("kernel %s: the guest could not flush its disks before the checkpoint: %s", self.id, e)
        if self._watch:
            self._watch.cancel()
        try:
            await driver.checkpoint(self.sandbox, image_dir)
        except BaseException as e:
            if self.sandbox and not self.sandbox.running:  # it stopped for good: say so, and clean up
                await self.teardown()
                self._die(f"checkpoint failed after the sandbox stopped: {e}")
            elif self.sandbox and self.sandbox.running:
                if self.sandbox.reader is not self.link.reader:
                    # The driver had to reconnect to the agent (Firecracker resets
                    # vsock on a snapshot): the link moves to the new stream.
                    await self.link.close()
                    self.link = AgentLink(self.sandbox.reader, self.sandbox.writer, self._on_kernel, self._on_event)
                    await self.link.request("reconnect", {"clock": time.time()}, timeout=30)
                self._watch = asyncio.ensure_future(self._watch_sandbox(asyncio.ensure_future(self.sandbox.wait())))
            raise
        old = self.link
        try:  # frames the agent wrote before it froze are still in the pipe
            await asyncio.wait_for(asyncio.shield(old.closed), 10)
        except asyncio.TimeoutError:
            pass
        await old.close()
        self.link = None
        await self.sandbox.destroy()
        self.sandbox = None

    async def checkpoint(self, name: str = "", resume: bool = True) -> Checkpoint:
        async with self.lock:
            await self._ensure_running()
            store = self.manager.checkpoints
            cid, _ = store.new_dir()
            t0 = time.monotonic()
            try:
                await self._stop_into(store.state_dir(cid))
            except BaseException:
                store.discard(cid)
                raise
            image = store.state_dir(cid)
            try:
                files, new = store.snapshot(self.workspace)  # while stopped: same instant as memory
                cp = Checkpoint(id=cid, sandbox=self.id, parent=self.head, created=time.time(), name=name,
                                state_bytes=dir_size(image), files=files,
                                files_bytes=sum(f.size for f in files.values()), new_bytes=new)
                store.commit(cp)  # from here on it is listed, and whole
            except BaseException:
                await self.boot(restore_from=image, consume=True)  # the sandbox carries on regardless
                store.discard(cid)
                raise
            self.head = cid
            if resume:
                try:
                    await self.boot(restore_from=image)
                except Exception as e:
                    self._die(f"checkpoint {cid} was saved, but the sandbox could not carry on from it: {e}")
                    raise SandboxError(self.failure) from None
            else:
                self.execution_state = "dead"
                self.failure = "stopped after its checkpoint"
            log.info("kernel %s: checkpoint %s in %.2f s (state %d B, %d new file bytes)", self.id, cid,
                     time.monotonic() - t0, cp.state_bytes, new)
            return cp

    @property
    def pause_mode(self) -> Optional[str]:
        return "disk" if self.paused else "memory" if self.frozen else None

    async def pause(self, mode: str = "disk") -> None:
        """``disk``: checkpoint and stop, memory freed. ``memory``: the driver
        freezes the sandbox where it is; resuming takes milliseconds."""
        async with self.lock:
            if self.paused or (self.frozen and mode == "memory"):
                return
            await self._ensure_running()  # a frozen sandbox paused to disk is thawed first
            if mode == "memory":
                await self.manager.drivers[self.driver].freeze(self.sandbox)
                self.frozen, self.execution_state = self.execution_state, "paused"
                log.info("kernel %s paused in memory", self.id)
                return
            image = self.manager.settings.home / "paused" / self.id
            shutil.rmtree(image, ignore_errors=True)
            await self._stop_into(image)
            self.paused = image
            self.execution_state = "paused"
            log.info("kernel %s paused (state on disk, %d B)", self.id, dir_size(image))

    async def resume(self) -> None:
        async with self.lock:
            await self._resume()

    async def _wake(self) -> None:
        """Resume for a client message that arrived while paused. If that
        fails, the senders get an error reply rather than waiting forever."""
        try:
            await self.resume()
        except Exception as e:
            self.held.clear()
            self._fail_pending(f"it could not be resumed: {e}")

    async def _resume(self) -> None:
        if self.frozen:
            await self.manager.drivers[self.driver].thaw(self.sandbox)
            self.execution_state, self.frozen = self.frozen, None
            self._send_held()
            log.info("kernel %s resumed in memory", self.id)
            return
        if not self.paused:
            return
        image = self.paused
        try:
            await self.boot(restore_from=image, consume=True)
        except BaseException:
            # The driver left the image whole (Driver.restore): still paused, and
            # the next call tries again; the reason stays on the sandbox meanwhile.
            self.execution_state = "paused"
            raise
        self.paused = None
        shutil.rmtree(image, ignore_errors=True)
        log.info("kernel %s resumed", self.id)

    async def execute(self, code: str, timeout: float, on_output=None) -> dict:
        """Run one cell and return its outputs; on timeout the cell is interrupted."""
        if self.paused:
            await self.resume()
        session, msg_id = uuid.uuid4().hex, uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": "execute_request", "session": session, "username": "sandgate",
                  "date": iso(utcnow()), "version": "5.3"}
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": True}
        parts = [json.dumps(header).encode(), b"{}", b"{}", json.dumps(content).encode()]
        collector = Collector(session)
        self.listeners.append(collector)  # no replay: that belongs to websocket clients
        outputs, reply, idle, status = [], None, False, "ok"
        try:
            self.send("shell", parts, header)
            deadline = time.monotonic() + timeout
            while not (reply and idle):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if status == "timeout":
                        break  # interrupted, and still no reply: give up waiting
                    status = "timeout"
                    await self.manager.interrupt(self.id)
                    # Wait for the interrupted cell to end, or ipykernel would
                    # abort the next request as part of the failed cell's queue.
                    deadline = time.monotonic() + 10
                    continue
                try:
                    channel, got = await asyncio.wait_for(collector.queue.get(), remaining)
                except asyncio.TimeoutError:
                    continue
                if msg_id.encode() not in got[1]:
                    continue
                h, c = json.loads(got[0]), json.loads(got[3])
                if channel == "shell" and h["msg_type"] == "execute_reply":
                    reply = c
                elif h["msg_type"] == "status":
                    idle = c.get("execution_state") == "idle"
                else:
                    out = output_of(h["msg_type"], c)
                    if out:
                        outputs.append(out)
                        if on_output:
                            await on_output(out)
        finally:
            self.detach(collector)
        if reply and status == "ok":
            status = reply.get("status", "ok")
        error = next((o for o in outputs if o["type"] == "error"), None)
        if error is None and reply and reply.get("status") == "error":
            error = output_of("error", reply)  # e.g. DeadKernelError: in the reply only
        return {"status": status, "execution_count": (reply or {}).get("execution_count"), "outputs": outputs,
                "stdout": "".join(o["text"] for o in outputs if o["type"] == "stream" and o["name"] == "stdout"),
                "stderr": "".join(o["text"] for o in outputs if o["type"] == "stream" and o["name"] == "stderr"),
                "error": error}

    async def ensure_running(self) -> None:
        async with self.lock:
            await self._ensure_running()

    async def _ensure_running(self) -> None:
        if self.paused or self.frozen:
            await self._resume()
        if self.execution_state == "dead" or not self.link:
            raise AgentError(f"kernel {self.id} is dead: {self.failure or 'no sandbox'}")

    async def _watch_sandbox(self, exited: asyncio.Future) -> None:
        link = self.link
        await asyncio.wait({exited, link.closed}, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():  # a dying sandbox closes its stream first: give it a moment
            await asyncio.wait({exited}, timeout=2)
        if not exited.done():
            # The stream broke (say, garbage from a compromised agent) while the
            # sandbox runs on: nothing could reach it any more, so it is stopped.
            reason = link.closed.result()
            log.error("kernel %s: agent stream lost (%s); stopping its sandbox", self.id, reason)
            await self.sandbox.destroy()
            self.failure = f"agent stream lost: {reason}"
        else:
            await asyncio.sleep(0.2)
            self.failure = self.sandbox.failure() if self.sandbox else "sandbox gone"
            if self.sandbox:  # the reason is kept; its leftovers (state, sockets, overlays) go now
                await self.sandbox.destroy()
        self._die(self.failure)
        if self.link:
            await self.link.close()

    def _die(self, why: str) -> None:
        """The sandbox is gone: the kernel says why, and nobody waits for it."""
        self.execution_state, self.failure, self.frozen = "dead", why, None
        log.error("kernel %s: %s", self.id, why)
        self._broadcast("iopub", status_message("dead"))
        self.held.clear()
        self._fail_pending(why)

    async def teardown(self) -> None:
        if self.frozen and self.sandbox:  # not every runtime kills a frozen sandbox cleanly
            try:
                await self.manager.drivers[self.driver].thaw(self.sandbox)
            except SandboxError:
                pass
            self.frozen = None
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
                # ipykernel's own "starting" can arrive after the agent said
                # ready; starting is the gateway's to say (boot, restart).
                if state and state != "starting" and json.loads(parts[0]).get("msg_type") == "status":
                    if self.frozen:  # sent just before the freeze: the state to return to
                        self.frozen = state
                    else:
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

    REPLAY_BYTES = 64 << 20

    def _keep(self, channel: str, parts: List[bytes]) -> None:
        size = sum(len(p) for p in parts)
        if len(self.replay) >= self.manager.settings.replay_messages or self.replay_bytes + size > self.REPLAY_BYTES:
            self.replay_dropped += 1
            return
        self.replay.append((channel, parts))
        self.replay_bytes += size

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
            # The new kernel's own "starting" can be published before the agent's
            # SUB socket reconnects; this one always arrives.
            self._broadcast("iopub", status_message("idle"))
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
        replay, self.replay, self.replay_bytes = self.replay, collections.deque(), 0
        if self.replay_dropped:
            log.warning("kernel %s: %d messages dropped while no client was connected", self.id, self.replay_dropped)
            self.replay_dropped = 0
        for channel, parts in replay:
            conn.deliver(channel, parts)

    def detach(self, conn: Listener) -> None:
        if conn in self.listeners:
            self.listeners.remove(conn)

    def send(self, channel: str, parts: List[bytes], header: dict) -> None:
        if self.paused or self.frozen or self.lock.locked() and not self.link:
            # Paused, or mid-checkpoint: hold the message; a paused kernel wakes up for it.
            self.held.append((channel, parts))
            if header.get("msg_type") == "execute_request":
                self.pending[header["msg_id"]] = header
            if self.paused or self.frozen:
                asyncio.ensure_future(self._wake())
            return
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
        self.checkpoints = CheckpointStore(settings.home / "checkpoints")
        self.checkpoints.sweep()  # leftovers of checkpoints a crash interrupted
        self._templates_file = settings.home / "templates.json"
        try:
            self.templates: Dict[str, str] = json.loads(self._templates_file.read_text())
        except (OSError, ValueError):
            self.templates = {}
        self._template_lock = asyncio.Lock()
        self.pool: Dict[str, List[Kernel]] = {}
        self._refilling: set = set()

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

    async def start(self, name: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                    checkpoint: Optional[str] = None, labels: Optional[Dict[str, str]] = None,
                    limits=None, ttl: Optional[float] = None) -> Kernel:
        """Start a kernel cold, or from a checkpoint (files and running state)."""
        cp = self.checkpoints.get(checkpoint) if checkpoint else None  # KeyError for an unknown one
        if cp:
            src = self.kernels.get(cp.sandbox)
            name = name or (src.name if src else None)
        spec = self.specs.get(name or self.specs.default)  # KeyError for an unknown name
        if len(self.kernels) + self._starting >= self.settings.max_kernels:
            raise LimitReached(f"Maximum number of kernels ({self.settings.max_kernels}) reached")
        kernel = Kernel(self, str(uuid.uuid4()), spec.name, spec.driver, self.kernel_env(env or {}))
        kernel.labels = labels or {}
        if limits is not None:
            kernel.limits = limits
        if ttl:
            kernel.expires = utcnow() + dt.timedelta(seconds=ttl)
        self._starting += 1
        try:
            pooled = None if cp or limits is not None else self._take_pooled(spec.driver)
            if pooled:  # warm, already running: the start costs one setup call
                pooled.id, pooled.name, pooled.env, pooled.labels, pooled.expires = \
                    kernel.id, kernel.name, kernel.env, kernel.labels, kernel.expires
                pooled.workspace_dir.rename(pooled.workspace)
                pooled.sandbox.spec.workspace = pooled.workspace
                kernel = pooled
                kernel.replay.clear()
                kernel.replay_bytes = 0
                kernel.created = kernel.last_activity = utcnow()  # time in the pool is not its age
                await kernel.link.request("setup", {"env": kernel.env}, timeout=30)
            else:
                if cp is None:
                    cp = self._ready_template(spec.driver)  # None until the template is made
                    src = None
                if cp:
                    if src:
                        kernel.env = src.env  # a fork keeps its parent's environment
                    if cp.id not in self.templates.values():
                        kernel.origin = kernel.head = cp.id
                    await self._restore(kernel, cp)
                else:
                    await kernel.boot()
        except BaseException:
            shutil.rmtree(kernel.workspace, ignore_errors=True)
            if kernel.sandbox:
                await kernel.teardown()
            raise
        finally:
            self._starting -= 1
        self.kernels[kernel.id] = kernel
        await self.store.put(kernel.id, {"driver": kernel.driver, "sandbox": kernel.sandbox.id})
        log.info("kernel %s started (%s, sandbox %s, %s)", kernel.id, kernel.driver, kernel.sandbox.id,
                 "from the warm pool" if pooled else f"from checkpoint {cp.id}" if cp else "cold")
        self._refill_pool(spec.driver)
        return kernel

    async def _restore(self, kernel: Kernel, cp: Checkpoint) -> None:
        self.checkpoints.materialize(cp, kernel.workspace, uid=1000 if os.geteuid() == 0 else None)
        await kernel.boot(restore_from=self.checkpoints.state_dir(cp.id))
        await kernel.link.request("setup", {"env": kernel.env}, timeout=30)

    # -- warm start --------------------------------------------------------
    def _template_key(self, driver: str) -> str:
        return f"{driver}:{images.image_dir(self.settings.home).name}:{self.agent_dir().name}"

    def _ready_template(self, driver: str) -> Optional[Checkpoint]:
        if not (self.settings.warm_start and self.drivers[driver].can_checkpoint):
            return None
        cid = self.templates.get(self._template_key(driver))
        try:
            return self.checkpoints.get(cid) if cid else None
        except KeyError:
            return None

    def warm(self) -> None:
        """Make the default driver's template and fill its pool in the
        background; other drivers warm up after their first kernel starts."""
        default = self.specs.get(self.specs.default).driver
        if self.drivers[default].can_checkpoint:
            self._refill_pool(default)

    async def template(self, driver: str) -> Optional[Checkpoint]:
        """The checkpoint of a freshly booted kernel that new kernels restore
        from instead of cold-starting Python; made once per image and agent."""
        if not self.settings.warm_start:
            return None
        key = self._template_key(driver)
        async with self._template_lock:
            cid = self.templates.get(key)
            if cid:
                try:
                    return self.checkpoints.get(cid)
                except KeyError:
                    pass
            t0 = time.monotonic()
            k = Kernel(self, "template-" + uuid.uuid4().hex[:8], "template", driver, {})
            try:
                await k.boot()
                cp = await k.checkpoint("template", resume=False)
            except Exception as e:
                log.warning("warm start off for %s: could not make a template: %s", driver, e)
                self.drivers[driver].can_checkpoint = False
                return None
            finally:
                await k.teardown()
                shutil.rmtree(k.workspace, ignore_errors=True)
            self.templates[key] = cp.id
            self._templates_file.write_text(json.dumps(self.templates))
            log.info("template checkpoint %s made for %s in %.1f s", cp.id, driver, time.monotonic() - t0)
            return cp

    def _take_pooled(self, driver: str) -> Optional[Kernel]:
        pool = self.pool.get(driver, [])
        while pool:
            k = pool.pop(0)
            if k.execution_state == "idle" and k.link and not k.link.closed.done():
                return k
            asyncio.ensure_future(k.teardown())
        return None

    def _refill_pool(self, driver: str) -> None:
        if not self.settings.warm_start or driver in self._refilling or not self.drivers[driver].can_checkpoint:
            return
        self._refilling.add(driver)
        asyncio.ensure_future(self._refill(driver))

    async def _refill(self, driver: str) -> None:
        try:
            pool = self.pool.setdefault(driver, [])
            cp = await self.template(driver)
            while cp and len(pool) < self.settings.pool_size:
                k = Kernel(self, "pool-" + uuid.uuid4().hex[:8], "pool", driver, {})
                k.workspace_dir = k.workspace
                self.checkpoints.materialize(cp, k.workspace, uid=1000 if os.geteuid() == 0 else None)
                await k.boot(restore_from=self.checkpoints.state_dir(cp.id))
                pool.append(k)
        except Exception as e:
            log.warning("could not refill the warm pool for %s: %s", driver, e)
        finally:
            self._refilling.discard(driver)

    async def fork(self, kernel_id: str, checkpoint: Optional[str] = None) -> Kernel:
        """A second running copy: from a named checkpoint, or from now."""
        source = self.get(kernel_id)
        if checkpoint is None:
            checkpoint = (await source.checkpoint("fork")).id
        elif self.checkpoints.get(checkpoint).sandbox != kernel_id:
            raise KeyError(checkpoint)  # forking through someone else's sandbox id is a mistake
        return await self.start(source.name, checkpoint=checkpoint)

    def gc(self) -> int:
        live = set(self.kernels)
        origins = {k.origin for k in self.kernels.values() if k.origin}
        return self.checkpoints.gc(live, origins | set(self.templates.values()))

    async def shutdown(self, kernel_id: str) -> None:
        kernel = self.kernels.pop(kernel_id, None)
        if kernel is None:
            raise NoSuchKernel(kernel_id)
        await self.store.delete(kernel_id)
        await kernel.teardown()
        shutil.rmtree(kernel.workspace, ignore_errors=True)
        if kernel.paused:
            shutil.rmtree(kernel.paused, ignore_errors=True)
        self.gc()
        log.info("kernel %s shut down", kernel_id)

    async def interrupt(self, kernel_id: str) -> None:
        kernel = self.get(kernel_id)
        if kernel.paused or kernel.frozen:
            return  # a paused kernel runs nothing
        if not kernel.link or kernel.execution_state == "dead":
            raise AgentError(f"kernel {kernel_id} is dead: {kernel.failure}")
        await kernel.link.request("interrupt", timeout=10)

    async def restart(self, kernel_id: str) -> Kernel:
        """Restart ipykernel in its sandbox; a dead sandbox is created anew
        over the same workspace, so files survive either way."""
        kernel = self.get(kernel_id)
        async with kernel.lock:
            return await self._restart(kernel)

    async def _restart(self, kernel: Kernel) -> Kernel:
        kernel_id = kernel.id
        if kernel.paused:
            await kernel._resume()
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

    async def reap(self) -> None:
        for name, driver in self.drivers.items():
            n = await driver.reap()
            if n:
                log.warning("removed %d %s sandboxes left by an earlier gateway process", n, name)
        for leftover in ("sandboxes", "paused", "workspaces"):
            shutil.rmtree(self.settings.home / leftover, ignore_errors=True)

    async def shutdown_all(self) -> None:
        if self._culler:
            self._culler.cancel()
        for pool in self.pool.values():
            for k in pool:
                await k.teardown()
                shutil.rmtree(k.workspace, ignore_errors=True)
        self.pool.clear()
        await asyncio.gather(*(self.shutdown(k) for k in list(self.kernels)), return_exceptions=True)

    def start_culler(self) -> None:
        if self._culler is None:
            self._culler = asyncio.ensure_future(self._cull_loop())

    async def _cull_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.settings.cull_interval, 10))  # ttl needs a finer clock
            now = utcnow()
            for k in list(self.kernels.values()):
                if k.expires and now > k.expires:
                    log.info("deleting sandbox %s: its ttl has passed", k.id)
                    await self.shutdown(k.id)
                    continue
                idle = (now - k.last_activity).total_seconds()
                pause_after = self.settings.pause_idle_timeout
                # A sandbox paused in memory still holds it: idle long enough, it goes to disk too.
                was_idle = k.execution_state == "idle" or k.frozen == "idle"
                if pause_after and not k.paused and was_idle and idle > pause_after and not k.lock.locked():
                    log.info("pausing kernel %s: idle %.0f s", k.id, idle)
                    try:
                        await k.pause()
                    except Exception as e:
                        log.warning("kernel %s: automatic pause failed: %s", k.id, e)
                    continue
                if not self.settings.cull_idle_timeout:
                    continue
                if not k.listeners and k.execution_state != "busy" and idle > self.settings.cull_idle_timeout:
                    log.info("culling kernel %s: idle %.0f s with no connection", k.id, idle)
                    try:
                        await self.shutdown(k.id)
                    except NoSuchKernel:
                        pass

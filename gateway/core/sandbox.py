"""One sandbox and its lifecycle: the only place its state changes.

A sandbox *is* a Jupyter kernel: its runtime (a driver's sandbox) runs the
guest agent, which runs ipykernel. This object holds the serialisable record
(core/record.py), the live runtime and agent link, the clients attached to
its kernel (core/fanout.py) and the messages held while it is not running.

Every lifecycle operation (checkpoint, pause, resume, restart, delete) takes
``lock``, moves the state through the table in core/states.py, and writes the
record to the store. Kernel messages never wait for the lock: in a holding
state they queue (bounded) and go out in order the moment the sandbox is
running again; only a sandbox that ends dead answers them with an error.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Dict, List, Optional

from sandgate_agent import protocol as P

from .. import faults, metrics
from ..agent_link import AgentError, AgentLink
from ..checkpoints import Checkpoint, OverQuota, SnapshotTooLarge, StoreQuota, dir_size
from ..drivers.base import Sandbox as Runtime
from ..drivers.base import SandboxError, SandboxSpec
from ..egress.policy import EgressPolicy
from ..workspace import Workspace, WorkspaceError, sandbox_uid
from . import states
from .errors import Conflict, LimitReached, NotFound, QuotaExceeded, SetupFailed, TooLarge, Unavailable
from .executions import Executions
from .fanout import FanOut, Listener
from .messages import ABORTED, error_reply, iso, iso_epoch, message, output_of, status_message, utcnow
from .record import SandboxRecord
from .states import State
from .tunnel import DEFAULT_PORT

if TYPE_CHECKING:
    from .manager import SandboxManager

log = logging.getLogger("sandgate.sandbox")

# Fault points (faults.py): before each step a crash or a failure could cut in two, and after
# (".done") where what follows is not itself a point.
point = faults.point
# Each store write of a state, by the operations that write it on their way.
WRITES = {State.RUNNING: ("start", "fork", "checkpoint", "resume", "restart"), State.CHECKPOINTING: ("checkpoint",),
          State.PAUSING: ("pause_disk", "pause_memory"), State.PAUSED: ("pause_disk",),
          State.FROZEN: ("pause_memory",), State.RESUMING: ("resume",), State.RESTARTING: ("restart",),
          State.DELETED: ("delete",)}
STORE = {st: point(f"store.{st.value}", *ops, error=OSError) for st, ops in WRITES.items()}
STORED = {st: point(f"store.{st.value}.done", *ops) for st, ops in WRITES.items()}
CREATE = point("driver.create", "start", "restart", error=SandboxError)
CREATED = point("driver.create.done", "start", "restart")
RESTORE = point("driver.restore", "fork", "resume", "checkpoint", error=SandboxError)
RESTORED = point("driver.restore.done", "fork", "resume", "checkpoint")
RECONNECT = point("agent.reconnect", "fork", "resume", "checkpoint", error=AgentError)
PING = point("agent.ping", "checkpoint", "pause_disk", error=AgentError)
CHECKPOINT = point("driver.checkpoint", "checkpoint", "pause_disk", error=SandboxError)
CHECKPOINTED = point("driver.checkpoint.done", "checkpoint", "pause_disk")
IN_PLACE = point("driver.checkpoint_in_place", "checkpoint", error=SandboxError)
IN_PLACE_DONE = point("driver.checkpoint_in_place.done", "checkpoint")
UNPAUSE = point("driver.unpause", "checkpoint", error=SandboxError)
FREEZE = point("driver.freeze", "pause_memory", error=SandboxError)
FROZE = point("driver.freeze.done", "pause_memory")
THAW = point("driver.thaw", "resume", error=SandboxError)
THAWED = point("driver.thaw.done", "resume")
DESTROY = point("runtime.destroy", "checkpoint", "pause_disk", "delete")
DESTROYED = point("runtime.destroy.done", "checkpoint", "pause_disk", "delete")
SNAPSHOT = point("checkpoint.snapshot", "checkpoint", error=OSError)
STORE_STATE = point("checkpoint.store_state", "checkpoint", error=OSError)
COMMIT = point("checkpoint.commit", "checkpoint", error=OSError)
COMMITTED = point("checkpoint.commit.done", "checkpoint")
HEAD = point("store.head", "checkpoint", error=OSError)
AGENT_RESTART = point("agent.restart", "restart", error=AgentError)
REMOVE_IMAGE = point("files.paused_image.remove", "resume", "pause_disk")
REMOVED_IMAGE = point("files.paused_image.remove.done", "resume")
WORKSPACE_DELETE = point("files.workspace.delete", "delete", error=WorkspaceError)
WORKSPACE_DELETED = point("files.workspace.delete.done", "delete")


def reconnect_args(egress: Optional[dict] = None, env: Optional[Dict[str, str]] = None) -> dict:
    """For an agent restored from a checkpoint: the host's clock (a VM's stood
    still), fresh randomness (every copy of one checkpoint has the same), and
    its egress (the listener was closed for the checkpoint; None keeps it so);
    with ``env``, `setup` too (the reply says "setup": true if it was done)."""
    return {"clock": time.time(), "entropy": os.urandom(32).hex(), "egress": egress,
            "setup": setup_args(env) if env is not None else None}


def setup_args(env: Dict[str, str]) -> dict:
    """Make a restored or pooled sandbox its own: its environment, new randomness."""
    return {"env": env, "entropy": os.urandom(32).hex()}


class Held:
    """Client messages waiting for the sandbox to run, bounded by count and bytes."""

    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.items: collections.deque = collections.deque()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def add(self, channel: str, parts: List[bytes]) -> bool:
        size = sum(len(p) for p in parts)
        if len(self.items) >= self.max_count or self.bytes + size > self.max_bytes:
            return False
        self.items.append((channel, parts))
        self.bytes += size
        return True

    def take(self) -> List[tuple]:
        items, self.items, self.bytes = list(self.items), collections.deque(), 0
        return items


class Collector:
    """An internal listener: gathers one cell's output for the sandbox API."""

    replay = False

    def __init__(self, session: str):
        self.session_ids = {session}
        self.queue: asyncio.Queue = asyncio.Queue()

    def deliver(self, channel: str, parts: List[bytes]) -> None:
        self.queue.put_nowait((channel, parts))


class Sandbox:
    def __init__(self, manager: "SandboxManager", record: SandboxRecord):
        self.manager = manager
        self.record = record
        self._stored = record.state  # the state the store holds, for compare-and-set
        self.runtime: Optional[Runtime] = None
        self.link: Optional[AgentLink] = None
        s = manager.settings
        self.fanout = FanOut(record.id, s.replay_messages)
        self.held = Held(s.held_messages, s.held_mb << 20)
        self.pending: Dict[str, dict] = {}  # execute_request headers awaiting their reply
        self.executions = Executions()  # recent execute ids: a retry runs nothing twice
        self._sent_at: Dict[str, float] = {}  # when each of those arrived (sandgate_execute_seconds)
        self.activity = "starting"  # the kernel's own execution_state: starting, idle, busy, restarting
        self.last_activity = utcnow()
        self.lock = asyncio.Lock()  # one lifecycle operation at a time
        self._saving = asyncio.Lock()  # one store write at a time
        self.ws = Workspace(s.home / "workspaces", record.id, record.limits.disk_mb, sandbox_uid(),
                            disk=manager.drivers[record.driver].shares_workspace)
        self.persistent = True  # False for the warm pool and templates: no record in the store
        self._watch: Optional[asyncio.Task] = None
        self._waking: Optional[asyncio.Task] = None

    # -- the record ----------------------------------------------------------
    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> State:
        return self.record.state

    @property
    def driver(self):
        return self.manager.drivers[self.record.driver]

    @property
    def workspace(self) -> Path:
        return self.ws.path

    @property
    def execution_state(self) -> str:
        """The Jupyter view: the kernel's own state while running."""
        st = self.state
        if st in (State.STARTING, State.RESTARTING):
            return st.value
        if st in (State.DEAD, State.DELETED):
            return "dead"
        if st in (State.PAUSED, State.FROZEN):
            return "paused"
        return self.activity

    def _set(self, new: State, **changes) -> State:
        """Move to ``new`` (the table must allow it) in memory, at once."""
        old = self.record.state
        states.check(old, new)
        if new in (State.RUNNING, State.FROZEN, State.DEAD):  # an image being taken is no longer its state
            changes.setdefault("paused_image", None)
        self.record = self.record.model_copy(update={"state": new, **changes})
        log.info("sandbox %s: %s -> %s%s", self.id, old, new,
                 f" ({self.record.reason})" if new == State.DEAD and self.record.reason else "")
        if new == State.RUNNING:
            self.last_activity = utcnow()  # idle time counts from here, not from before a long start
            self._send_held()
        elif new in states.WAKES and self.held:
            self._wake()  # messages that came while it was on its way to paused: they want it back
        elif new in (State.DEAD, State.DELETED):
            why = self.record.reason if new == State.DEAD else "the sandbox was deleted"
            self._fail_waiting(why or "no sandbox")
        return old

    async def save(self) -> None:
        """Write the record; compare-and-set against the state last written."""
        if not self.persistent:
            return
        async with self._saving:  # one write at a time, each of the newest record
            rec = self.record
            if rec.state == State.DELETED:
                await self.manager.store.delete(rec.id)
                return
            if not await self.manager.store.compare_and_set(rec, self._stored):
                # Another writer moved it: ours is the live copy on this node; say so loudly.
                current = await self.manager.store.get(rec.id)
                log.error("sandbox %s: store held %s where %s was expected; writing %s", self.id,
                          current.state if current else "nothing", self._stored, rec.state)
                written = await self.manager.store.put(rec)
            else:
                written = rec.model_copy(update={"version": rec.version + 1})
            self._stored = rec.state
            if self.record is rec:  # not changed meanwhile: the version is the store's
                self.record = written

    async def to(self, new: State, **changes) -> None:
        if new in STORE:
            STORE[new]()  # before the state changes: a failure leaves memory and store as they were
        self._set(new, **changes)
        await self.save()
        if new in STORED:
            STORED[new]()

    def to_now(self, new: State, **changes) -> None:
        """For callbacks that cannot wait (the runtime died): memory now, store soon."""
        self._set(new, **changes)
        asyncio.ensure_future(self.save())

    def _not_deleted(self) -> None:
        """A call that came during a DELETE, or waited for one, finds nothing: 404, as after it."""
        if self.state == State.DELETED:
            raise NotFound(f"Sandbox does not exist: {self.id}")

    def _conflict(self, hint: str = "") -> Conflict:
        """This state cannot serve the request: 409, naming the state and why."""
        why = self.record.reason or ("no runtime" if self.state != State.RUNNING else "")
        return Conflict(f"sandbox {self.id} is {self.state}" + (f": {why}" if why else "") + hint,
                        state=self.state.value)

    def model(self) -> dict:
        """The Jupyter kernel model."""
        m = {"id": self.id, "name": self.record.kernel_name, "last_activity": iso(self.last_activity),
             "execution_state": self.execution_state, "connections": len(self.fanout), "driver": self.record.driver,
             "created": iso_epoch(self.record.created)}
        if self.record.expires:
            m["expires"] = iso_epoch(self.record.expires)
        if self.record.reason:
            m["reason"] = self.record.reason
        return m

    # -- the runtime ---------------------------------------------------------
    def new_spec(self) -> SandboxSpec:
        s, r = self.manager.settings, self.record
        return SandboxSpec(id=f"sg-{self.id}-{uuid.uuid4().hex[:6]}", rootfs=self.manager.rootfs(),
                           agent_dir=self.manager.agent_dir(), workspace=self.workspace,
                           state_dir=s.home / "sandboxes" / self.id, env=r.env, limits=r.limits,
                           workspace_seed=self.manager.checkpoints.state_dir(r.head) if r.head else None)

    async def fill_workspace(self, cp: Checkpoint) -> None:
        """The checkpoint's files into this sandbox's (new, empty) workspace."""
        try:
            await self.ws.create()
            await self.manager.checkpoints.materialize_async(cp, self.workspace,
                                                             self.ws.uid if os.geteuid() == 0 else None)
        except (OSError, WorkspaceError) as e:
            raise Unavailable(f"sandbox {self.id}: could not restore checkpoint {cp.id}'s files: {e}") from None

    async def setup(self, env: Dict[str, str]) -> None:
        """Make a restored, pooled or VM sandbox its own (env, randomness); the
        runtime is torn down if its agent refuses."""
        try:
            await self.link.request("setup", setup_args(env), timeout=30)
        except AgentError as e:
            await self._setup_failed(str(e))

    async def _setup_failed(self, why: str) -> None:
        await self.teardown()
        raise SetupFailed(f"sandbox {self.id}: its agent could not take its environment: {why}") from None

    async def boot(self, restore_from: Optional[Path] = None, consume: bool = False,
                   setup_env: Optional[Dict[str, str]] = None) -> None:
        """Start the runtime, cold or from a checkpoint image (``consume``: the
        image may be moved, see Driver.restore); the caller owns the state.
        With ``setup_env`` a restored sandbox is made its own (``setup``).
        Raises Unavailable with the reason when the runtime does not come up."""
        s = self.manager.settings
        spec = self.new_spec()
        t0 = time.monotonic()
        try:
            await self.ws.create()  # nothing if it exists (restart, resume)
            (RESTORE if restore_from else CREATE)()
            runtime = await (self.driver.restore(spec, restore_from, consume) if restore_from
                             else self.driver.create(spec))
            (RESTORED if restore_from else CREATED)()
        except (SandboxError, WorkspaceError) as e:
            raise Unavailable(f"sandbox {self.id} failed to {'restore' if restore_from else 'start'}: {e}") from None
        exited = self._attach(runtime)
        if restore_from:
            try:
                RECONNECT()
            except AgentError as e:  # as if the agent had refused: the runtime goes with the error
                exited.cancel()
                await self.teardown()
                raise Unavailable(f"sandbox {self.id} failed to restore: {e}") from None
        # A restored agent said "ready" long ago; it is asked to reconnect instead.
        ready = asyncio.ensure_future(self.link.request("reconnect", reconnect_args(self._egress_args(), setup_env),
                                                        timeout=s.kernel_start_timeout)
                                      if restore_from else self.link.ready)
        done, _ = await asyncio.wait({ready, exited}, timeout=s.kernel_start_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ready not in done or ready.exception():
            if not exited.done():  # a dying runtime closes its stream first: its last words follow
                await asyncio.wait({exited}, timeout=1)
            if exited.done():
                why = runtime.failure()
            elif ready.done():
                why = str(ready.exception())
            else:
                why = f"agent not ready within {s.kernel_start_timeout:g} s ({runtime.failure()})"
            ready.cancel()
            exited.cancel()
            await self.teardown()
            raise Unavailable(f"sandbox {self.id} failed to {'restore' if restore_from else 'start'}: {why}")
        if restore_from:
            metrics.RESTORE.labels(self.record.driver).observe(time.monotonic() - t0)
            log.info("sandbox %s: restored by %s in %.0f ms", self.id, self.record.driver,
                     (time.monotonic() - t0) * 1000)
            self.driver.after_restore(runtime)
        said = ready.result()[0] if restore_from else {}  # the reconnect's answer
        if said.get("egress_error"):
            log.warning("sandbox %s: its egress listener did not reopen after the restore: %s", self.id,
                        said["egress_error"])
        if restore_from and setup_env is not None:
            try:
                if said.get("setup_error"):
                    await self._setup_failed(said["setup_error"])
                if not said.get("setup"):
                    await self.setup(setup_env)  # an agent from before `setup` rode on `reconnect`
            except SetupFailed:
                exited.cancel()
                raise
        if not restore_from and self.record.env and not self.driver.env_at_boot:
            await self.setup(self.record.env)
        if not restore_from and self._egress_args():
            try:
                await self._apply_egress()
            except AgentError as e:
                await self.teardown()
                raise Unavailable(f"sandbox {self.id}: its agent could not open its egress listener: {e}") from None
        # A cell that was running at the checkpoint runs on after the restore.
        self.activity = "busy" if self.pending else "idle"
        self.record = self.record.model_copy(update={"runtime": runtime.id})
        self._watch = asyncio.ensure_future(self._watch_runtime(exited))

    async def boot_checkpoint(self, cid: str, setup_env: Optional[Dict[str, str]] = None) -> None:
        """``boot`` from checkpoint ``cid``'s running state (assembled from its chunks if stored so)."""
        try:
            # A template is restored at every start from an empty pool: its image is assembled once.
            async with self.manager.checkpoints.restorable(cid, keep=self.manager.pool.is_template(cid)) as image:
                await self.boot(restore_from=image, setup_env=setup_env)
        except (OSError, ValueError) as e:  # a chunk or the manifest missing or damaged
            raise Unavailable(f"sandbox {self.id} failed to restore checkpoint {cid}: {e}") from None

    def _attach(self, runtime: Runtime) -> asyncio.Future:
        """Take ``runtime`` and a link to its agent; returns its exit, awaited."""
        self.runtime = runtime
        self.link = self._link(runtime)
        return asyncio.ensure_future(runtime.wait())

    async def adopt(self, runtime: Runtime) -> None:
        """Take over a runtime that an earlier gateway process left running
        (it was killed): a running sandbox's agent must answer; a frozen one
        answers once thawed. Raises Unavailable, with the runtime torn down."""
        runtime.spec.workspace = self.workspace  # a pooled one was started under another name
        exited = self._attach(runtime)
        if self.state not in (State.RUNNING, State.FROZEN):
            # Caught mid-operation (a checkpoint or pause not taken, a restart, a thaw): whatever
            # stopped the runtime where it is is undone, and it runs on as before.
            await self.driver.undo_pause(runtime)
        if self.state != State.FROZEN:
            try:
                await self.link.request("ping", timeout=self.manager.settings.kernel_start_timeout)
            except AgentError as e:
                exited.cancel()
                await self.teardown()
                raise Unavailable(f"its agent does not answer: {e}") from None
        self.activity = "idle"  # a cell still running says busy as its output arrives
        self._watch = asyncio.ensure_future(self._watch_runtime(exited))

    # -- egress (core/tunnel.py) ----------------------------------------------
    def _link(self, runtime: Runtime) -> AgentLink:
        return AgentLink(runtime.reader, runtime.writer, self._on_kernel, self._on_event,
                         tunnel_opener=self._open_tunnel)

    async def _open_tunnel(self):
        """The host side of one egress connection the agent carries."""
        hook = self.manager.egress
        if hook is None or self.record.egress_port is None:
            raise ConnectionRefusedError("egress is off for this sandbox")
        return await hook.connect(self.id)

    def _egress_args(self) -> Optional[dict]:
        """What the agent gets in `egress` and `reconnect`; None: no egress."""
        hook = self.manager.egress
        if hook is None or self.record.egress_port is None:
            return None
        return {"port": self.record.egress_port, "ca_pem": hook.ca_pem}

    def publish_egress(self) -> None:
        """Tell the proxy what this sandbox may reach and add (or that it may reach nothing)."""
        hook, r = self.manager.egress, self.record
        if hook is None:
            return
        if r.egress is None:
            hook.forget(self.id)
        else:
            hook.set_policy(self.id, r.egress, r.secrets, {s.name: r.env[s.name] for s in r.secrets
                                                           if s.name and s.name in r.env})

    async def change_egress(self, policy: EgressPolicy) -> None:
        """A new policy while it lives (PATCH .../egress): the proxy checks every
        request from now on against it; a sandbox that had none gets its listener.
        All of it or nothing: see _change_egress."""
        async with self.lock:
            port = DEFAULT_PORT if self.record.egress_port is None else self.record.egress_port
            await self._change_egress(egress=policy, egress_port=port)

    async def _apply_egress(self) -> None:
        """The agent's listener and proxy environment to match the record."""
        await self.link.request("egress", self._egress_args() or {"port": None}, timeout=30)
        if self._egress_args() is None:
            await self.link.tunnels.close_all("egress turned off")

    async def set_egress(self, port: Optional[int]) -> None:
        """Egress on (the agent's proxy listener on 127.0.0.1:``port`` inside,
        HTTP(S)_PROXY pointing at it, the proxy's CA trusted) or off (None).
        Applied now if the sandbox runs (a frozen one is thawed first), at its
        resume if it is paused; kept in the record through checkpoints and
        restarts. Without ``manager.egress`` set, nothing is opened."""
        async with self.lock:
            await self._change_egress(egress_port=port)

    async def _change_egress(self, **changes) -> None:
        """With the lock held: the record's egress fields changed, the proxy told, and the
        agent's listener made to match, all of it or nothing: a dead sandbox is a 409 (a
        deleted one a 404) and a listener the agent cannot open (a cell holding its port,
        say) a 503 that leaves record, proxy and listener as they were."""
        self._not_deleted()
        if self.state == State.DEAD:
            raise self._conflict("; restart it first")
        old = {k: getattr(self.record, k) for k in changes}
        listener = "egress_port" in changes and changes["egress_port"] != self.record.egress_port
        if listener and self.state == State.FROZEN:
            await self._resume()  # thawed first: its agent opens or closes the listener now
        self.record = self.record.model_copy(update=changes)
        self.publish_egress()  # before the listener opens: its first connection finds the policy
        if listener and self.state == State.RUNNING and self.link:
            try:
                await self._apply_egress()
            except AgentError as e:
                self.record = self.record.model_copy(update=old)
                self.publish_egress()
                try:  # the agent's side back as it was, as far as it goes
                    await self._apply_egress()
                except AgentError:
                    pass
                raise Unavailable(f"sandbox {self.id}: its agent could not change its egress, which is left as "
                                  f"it was: {e}") from None
        await self.save()

    async def teardown(self, frozen: Optional[bool] = None) -> None:
        """Stop the runtime, if any; files and record stay. ``frozen``: whether the
        runtime is frozen, where the state no longer says (a delete)."""
        if (self.state == State.FROZEN if frozen is None else frozen) and self.runtime:
            # not every runtime kills a frozen sandbox cleanly
            try:
                await self.driver.thaw(self.runtime)
            except SandboxError:
                pass
        if self._watch:
            self._watch.cancel()
            self._watch = None
        if self.link:
            await self.link.close()
            self.link = None
        if self.runtime:
            DESTROY()
            await self.runtime.destroy()
            DESTROYED()
            self.runtime = None
        self.record = self.record.model_copy(update={"runtime": None})

    async def _watch_runtime(self, exited: asyncio.Future) -> None:
        link, runtime = self.link, self.runtime
        await asyncio.wait({exited, link.closed}, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():  # a dying runtime closes its stream first: give it a moment
            await asyncio.wait({exited}, timeout=2)
        if not exited.done():
            # The stream broke (say, garbage from a compromised agent) while the
            # runtime runs on: nothing could reach it any more, so it is stopped.
            why = f"agent stream lost: {link.closed.result()}"
            log.error("sandbox %s: %s; stopping its runtime", self.id, why)
        else:
            why = runtime.failure()
        async with self.lock:  # after any lifecycle operation in flight, which may have replaced the runtime
            if self.runtime is not runtime:
                return
            self._watch = None  # teardown must not cancel this task: it is this task
            await self.teardown()
            if self.state not in (State.DEAD, State.DELETED):
                await self.to(State.DEAD, reason=why)
                self.fanout.broadcast("iopub", status_message("dead"))

    async def _ready_for_image(self) -> Optional[dict]:
        """What every checkpoint needs first; returns the egress listener's
        arguments, for opening it again once the image is taken."""
        # A barrier: the agent reads its stream in order, so once it answers, every
        # frame sent before is inside the sandbox (and so in the image), not in a
        # host pipe that the checkpoint would leave behind.
        if not self.link:
            raise Unavailable(f"sandbox {self.id} has no runtime to checkpoint")
        # This runsc cannot checkpoint a TCP socket: the agent closes its egress
        # listener and every tunnelled connection (their clients get a reset),
        # and opens the listener again after the restore (`reconnect`).
        egress = self._egress_args()
        if self.record.egress_port is not None:  # (even with no hook now: the agent may still listen)
            try:
                await self.link.request("quiesce", timeout=30)
            except AgentError as e:
                raise Unavailable(f"sandbox {self.id} cannot be checkpointed: its agent could not close its "
                                  f"egress connections: {e}") from None
            await self.link.tunnels.close_all("the sandbox is being checkpointed", tell_peer=False)
        try:
            PING()
            await self.link.request("ping", timeout=30)
        except AgentError as e:
            await self._reopen_egress(egress)
            raise Unavailable(f"sandbox {self.id} cannot be checkpointed: its agent does not answer: {e}") from None
        if self.driver.sync_before_checkpoint:
            try:
                await self.link.request("sync", timeout=60)
            except AgentError as e:  # the memory image still holds what was not flushed
                log.warning("sandbox %s: the guest could not flush its disks before the checkpoint: %s", self.id, e)
        return egress

    async def _pause_into(self, image_dir: Path) -> Optional[dict]:
        """Checkpoint the running runtime into ``image_dir``, leaving it paused where
        it was (``_unpause`` ends that); if that fails, it runs on untouched."""
        egress = await self._ready_for_image()
        try:
            IN_PLACE()
            await self.driver.checkpoint_in_place(self.runtime, image_dir)
            IN_PLACE_DONE()
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                await self._reopen_egress(egress)
                raise
            why = await self._runs_on()
            if why is None:
                await self._reopen_egress(egress)
                raise Unavailable(f"checkpoint of sandbox {self.id} failed; it runs on: {e}") from None
            await self.teardown()
            await self.to(State.DEAD, reason=f"checkpoint failed and the sandbox died with it: {e}; {why}")
            raise Unavailable(f"checkpoint of sandbox {self.id} failed: {self.record.reason}") from None
        return egress

    async def _unpause(self, image: Path, egress: Optional[dict], after: str) -> None:
        """From the pause ``_pause_into`` left: running again, the egress listener
        open; if the runtime cannot go on, a restore from the image just taken."""
        try:
            UNPAUSE()
            await self.driver.unpause(self.runtime)
        except SandboxError as e:
            log.warning("sandbox %s: could not carry on in place (%s); restoring it from its image", self.id, e)
            await self.teardown()
            await self._carry_on(image, consume=False, after=after)
            return
        await self._reopen_egress(egress)
        await self.to(State.RUNNING, reason=None)

    async def _stop_into(self, image_dir: Path) -> None:
        """Checkpoint the running runtime into ``image_dir``; it is stopped after.
        If the driver fails first, the runtime keeps running untouched."""
        egress = await self._ready_for_image()
        if self._watch:
            self._watch.cancel()
            self._watch = None
        try:
            CHECKPOINT()
            await self.driver.checkpoint(self.runtime, image_dir)
            CHECKPOINTED()
        except BaseException as e:
            why, reconnected = None, False
            if self.runtime and self.runtime.running:
                if self.runtime.reader is not self.link.reader:
                    # The driver had to reconnect to the agent (Firecracker resets
                    # vsock on a snapshot): the link moves to the new stream.
                    await self.link.close()
                    self.link = self._link(self.runtime)
                    try:
                        await self.link.request("reconnect", reconnect_args(egress), timeout=30)
                        reconnected = True  # its egress listener too
                    except AgentError as gone:
                        why = f"its agent did not reconnect: {gone}"
                if not isinstance(e, asyncio.CancelledError):
                    why = why or await self._runs_on()
                if why is None:
                    if not reconnected:
                        await self._reopen_egress(egress)
                    self._watch = asyncio.ensure_future(self._watch_runtime(asyncio.ensure_future(self.runtime.wait())))
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    raise Unavailable(f"checkpoint of sandbox {self.id} failed; it runs on: {e}") from None
            else:
                why = self.runtime.failure() if self.runtime else "no runtime"
            await self.teardown()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise _Stopped(f"checkpoint failed and the sandbox died with it: {e}; {why}") from None
        old = self.link
        try:  # frames the agent wrote before it froze are still in the pipe
            await asyncio.wait_for(asyncio.shield(old.closed), 10)
        except asyncio.TimeoutError:
            pass
        await self.teardown()

    async def _runs_on(self) -> Optional[str]:
        """After a checkpoint the driver failed: None if the sandbox really runs on (its
        runtime is up and its agent answers), else why not. A runsc can fail a checkpoint
        and kill its sandbox with it (one io_uring descriptor did: issue 29, finding 6),
        its shim not yet gone when the error comes back: the answer must say which."""
        runtime, link = self.runtime, self.link
        if runtime is None or link is None:
            return "no runtime"
        exited = asyncio.ensure_future(runtime.wait())
        ping = asyncio.ensure_future(link.request("ping", timeout=30))
        try:
            await asyncio.wait({exited, ping}, return_when=asyncio.FIRST_COMPLETED)
            if ping.done() and not ping.exception() and runtime.running:
                return None
            if not exited.done():  # a dying runtime closes its stream first: its last words follow
                await asyncio.wait({exited}, timeout=2)
            if exited.done():
                return runtime.failure()
            return f"its agent no longer answers ({ping.exception() if ping.done() else 'no answer'})"
        finally:
            for f in (exited, ping):
                f.cancel()
            if ping.done() and not ping.cancelled():
                ping.exception()  # retrieved: a failed ping is this answer's, not a loose end

    async def _reopen_egress(self, egress: Optional[dict]) -> None:
        """A checkpoint that did not happen: the listener opens again."""
        if egress and self.link and not self.link.closed.done():
            try:
                await self.link.request("egress", egress, timeout=30)
            except AgentError as e:
                log.warning("sandbox %s: could not reopen its egress listener: %s", self.id, e)

    async def _stop(self, image_dir: Path) -> None:
        """``_stop_into`` from checkpointing or pausing; a failure leaves the
        sandbox running again, or dead (with why) if its runtime had stopped."""
        try:
            await self._stop_into(image_dir)
        except _Stopped as e:
            await self.to(State.DEAD, reason=str(e))
            raise Unavailable(str(e)) from None
        except BaseException:
            if self.state in (State.CHECKPOINTING, State.PAUSING):
                await self.to(State.RUNNING)
            raise

    # -- lifecycle operations ------------------------------------------------
    async def _run_again(self, shutdown: bool = False) -> None:
        """Called with the lock held: make sure it is running (resume a paused
        or frozen one); Conflict if it cannot serve, naming the state. Once the
        gateway is shutting down nothing is woken (its pause would be undone)."""
        self._not_deleted()
        if self.manager.stopping and not shutdown:
            raise Unavailable("the gateway is shutting down; the sandbox resumes after its restart")
        if self.state in states.WAKES:
            await self._resume()
        if self.state != State.RUNNING:
            raise self._conflict()

    async def checkpoint(self, name: str = "", resume: bool = True, quota: Optional[StoreQuota] = None) -> Checkpoint:
        """``quota``: what the owner's checkpoints may still store; past it the checkpoint is
        refused (QuotaExceeded) and nothing of it kept."""
        with faults.operation("checkpoint"):
            async with self.lock:
                await self._run_again()
                return await self._checkpoint(name, resume, quota)

    async def _checkpoint(self, name: str, resume: bool, quota: Optional[StoreQuota] = None) -> Checkpoint:
        store = self.manager.checkpoints
        cid, _ = store.new_dir()
        image = store.state_dir(cid)
        # The record names the image being taken: a gateway killed once it is whole and the
        # runtime stopped resumes the sandbox from it, memory and all (manager.recover).
        await self.to(State.CHECKPOINTING, paused_image=str(image))
        t0 = time.monotonic()
        # In place where the driver can (the sandbox waits paused, then goes on), else
        # stopped by the checkpoint and restored from it.
        in_place, egress = resume and self.driver.checkpoints_in_place, None
        try:
            if in_place:
                egress = await self._pause_into(image)
            else:
                await self._stop(image)
        except BaseException:
            if in_place and self.state == State.CHECKPOINTING:
                await self.to(State.RUNNING)
            store.discard(cid)
            raise
        owner = self.record.owner  # blobs deduplicated within the tenant only
        try:
            SNAPSHOT()
            files, new = await store.snapshot_async(self.workspace, cid=cid, owner=owner,  # stopped: same instant as memory
                                                    quota=quota)
        except BaseException as e:
            if in_place:  # the sandbox carries on regardless
                await self._unpause(image, egress, after="")
            else:
                await self._carry_on(image, consume=True)
            store.discard(cid)
            if isinstance(e, asyncio.CancelledError):
                raise
            if isinstance(e, SnapshotTooLarge):
                raise LimitReached(f"no checkpoint of sandbox {self.id} (it runs on): {e}") from None
            if isinstance(e, OverQuota):
                raise QuotaExceeded(f"no checkpoint of sandbox {self.id} (it runs on): {e}") from None
            raise Unavailable(f"checkpoint of sandbox {self.id} failed; it runs on: {e}") from None
        # The sandbox goes on from the whole image first, and the image is cut into chunks
        # after (state_chunks.py): that work costs the checkpoint call time, not the sandbox.
        # A sandbox that cannot go on is dead with the reason; its checkpoint is still kept.
        carry_on_failed = None
        if resume:
            try:
                if in_place:
                    await self._unpause(image, egress, after=f"checkpoint {cid} was taken, but")
                else:
                    await self._carry_on(image, consume=False, after=f"checkpoint {cid} was taken, but")
            except Unavailable as e:
                carry_on_failed = e
        try:
            STORE_STATE()
            state_bytes, state_new = await asyncio.to_thread(store.store_state, cid, owner, self.driver.state_images)
            if quota is not None and state_new + new > quota.left:  # the image's share is known only now
                raise quota.refuse(state_new + new)
            cp = Checkpoint(id=cid, sandbox=self.id, owner=owner, driver=self.record.driver, parent=self.record.head,
                            created=time.time(), name=name,
                            state_bytes=state_bytes, files=files,
                            files_bytes=sum(f.size for f in files.values() if f.link is None), new_bytes=new,
                            stored_bytes=state_new + new, executions=self.executions.to_record())
            COMMIT()
            await asyncio.to_thread(store.commit, cp)  # from here on it is listed, and whole
            COMMITTED()
            # Its image assembled now, in the background, so that forking it skips that step.
            store.assemble_ahead(cid, protect=self.manager.pool.templates.values())
        except BaseException as e:
            store.discard(cid)
            if not resume:  # stopped for good by the checkpoint, which is lost: say so
                await self.to(State.DEAD, reason=f"stopped for a checkpoint that could not be stored: {e}")
            if isinstance(e, asyncio.CancelledError) or carry_on_failed:
                raise carry_on_failed or e
            if isinstance(e, OverQuota):
                await asyncio.to_thread(store.sweep)  # its new chunks: the quota is not to be passed on disk either
                raise QuotaExceeded(f"no checkpoint of sandbox {self.id}{' (it runs on)' if resume else ''}: {e}") from None
            raise Unavailable(f"checkpoint of sandbox {self.id} failed{'; it runs on' if resume else ''}: {e}") from None
        self.record = self.record.model_copy(update={"head": cid})
        # Stored now: the carry-on saved the record before the head existed, and a fleet node
        # taking this sandbox over after its node dies resumes it from the stored head.
        if resume:
            HEAD()
            await self.save()
        if carry_on_failed:
            raise carry_on_failed
        if not resume:
            await self.to(State.DEAD, reason="stopped after its checkpoint")
        log.info("sandbox %s: checkpoint %s%s in %.2f s (state %d B, %d B stored, %d of them new file bytes)",
                 self.id, cid, " in place" if in_place else "", time.monotonic() - t0, cp.state_bytes,
                 cp.stored_bytes, new)
        metrics.CHECKPOINTS.labels(self.record.driver).inc()
        metrics.CHECKPOINT_BYTES.labels(self.record.driver, "state").inc(cp.state_bytes)
        metrics.CHECKPOINT_BYTES.labels(self.record.driver, "files").inc(new)
        return cp

    async def _carry_on(self, image: Path, consume: bool, after: str = "") -> None:
        """Back to running from the image just taken, or dead saying why."""
        try:
            await self.boot(restore_from=image, consume=consume)
        except Unavailable as e:
            why = f"{after} the sandbox could not carry on from it: {e}" if after else str(e)
            await self.to(State.DEAD, reason=why.strip())
            raise Unavailable(self.record.reason) from None
        await self.to(State.RUNNING, reason=None)

    async def pause(self, mode: str = "disk", shutdown: bool = False) -> None:
        """``disk``: checkpoint and stop, memory freed. ``memory``: the driver
        freezes the runtime where it is; resuming takes milliseconds."""
        with faults.operation("pause_disk" if mode == "disk" else "pause_memory"):
            await self._pause_locked(mode, shutdown)

    async def _pause_locked(self, mode: str, shutdown: bool) -> None:
        async with self.lock:
            if self.state == State.PAUSED or (self.state == State.FROZEN and mode == "memory"):
                return
            if self.state == State.FROZEN:  # to disk from memory: thawed first, then checkpointed
                await self._resume()
            await self._run_again(shutdown)
            await self._pause(mode)

    async def _pause(self, mode: str) -> None:
        image = self.manager.settings.home / "paused" / self.id
        await self.to(State.PAUSING, paused_image=str(image) if mode == "disk" else None)
        if mode == "memory":
            try:
                FREEZE()
                await self.driver.freeze(self.runtime)
                FROZE()
            except SandboxError as e:
                await self.to(State.RUNNING)
                raise Unavailable(f"could not pause sandbox {self.id} in memory: {e}") from None
            await self.to(State.FROZEN, pause_mode="memory")
            return
        REMOVE_IMAGE()
        shutil.rmtree(image, ignore_errors=True)
        await self._stop(image)
        await self.to(State.PAUSED, pause_mode="disk", paused_image=str(image))
        log.info("sandbox %s paused (state on disk, %d B)", self.id, dir_size(image))

    async def resume(self) -> None:
        with faults.operation("resume"):
            await self._resume_locked()

    async def _resume_locked(self) -> None:
        self._not_deleted()
        async with self.lock:
            self._not_deleted()  # deleted while this waited: not a 200 "deleted"
            if self.manager.stopping:
                raise Unavailable("the gateway is shutting down; the sandbox resumes after its restart")
            if self.state in states.WAKES:
                await self._resume()
            elif self.state == State.DEAD:
                raise self._conflict("; restart it instead")

    async def _resume(self) -> None:
        r = self.record
        await self.to(State.RESUMING)
        if r.state == State.FROZEN:
            try:
                THAW()
                await self.driver.thaw(self.runtime)
                THAWED()
            except SandboxError as e:
                await self.teardown()
                await self.to(State.DEAD, reason=f"could not be thawed: {e}", pause_mode=None)
                raise Unavailable(self.record.reason) from None
            await self.to(State.RUNNING, pause_mode=None)
            return
        if r.paused_image:
            image, consume = Path(r.paused_image), True
        elif r.resume_from:
            image, consume = None, False
            self._recall_executions(r.resume_from)
        else:
            await self.to(State.DEAD, reason="paused without a running-state image")
            raise Unavailable(self.record.reason)
        try:
            if image is None:
                await self.boot_checkpoint(r.resume_from)
            else:
                await self.boot(restore_from=image, consume=consume)
        except Unavailable as e:
            # The driver left the image whole (Driver.restore): still paused, and
            # the next call tries again; the reason stays on the sandbox meanwhile.
            await self.to(State.PAUSED, reason=str(e))
            raise
        # Running (with its runtime) in the store before the image goes: a gateway killed
        # in between finds either the image (paused again) or the runtime (adopted).
        await self.to(State.RUNNING, paused_image=None, pause_mode=None, resume_from=None,
                      reason=None if not r.resume_from else r.reason)
        if consume:
            REMOVE_IMAGE()
            shutil.rmtree(image, ignore_errors=True)
            REMOVED_IMAGE()
        if r.resume_from:  # clients learn what the recovery cost them, on the kernel's own channel
            self.fanout.broadcast("iopub", message("stream", {"name": "stderr", "text": f"[sandgate: {r.reason}]\n"}))
            self.fanout.broadcast("iopub", status_message("idle"))
        log.info("sandbox %s resumed", self.id)

    def _wake(self) -> None:
        """A message arrived while paused: resume. If that fails, the held
        messages get an error reply rather than waiting forever."""
        if (self._waking and not self._waking.done()) or self.manager.stopping:
            return  # a gateway on its way out pauses sandboxes; it does not wake them

        async def wake():
            try:
                await self.resume()
            except Exception as e:
                kept = self.state == State.PAUSED
                self._fail_waiting(f"The sandbox could not be resumed to run this cell: {e}"
                                   + ("; it is still paused, its state kept, and the next request tries again"
                                      if kept else ""), ename="SandboxUnavailable")

        self._waking = asyncio.ensure_future(wake())

    async def interrupt(self) -> None:
        if self.state in states.HOLDING and self.state not in states.WAKES:
            async with self.lock:  # after the checkpoint or restart in flight
                pass
        if self.state in states.WAKES:
            return  # a paused kernel runs nothing
        self._not_deleted()
        if self.state != State.RUNNING or not self.link:
            raise self._conflict()
        try:
            await self.link.request("interrupt", timeout=10)
        except AgentError as e:
            raise Unavailable(f"could not interrupt sandbox {self.id}: {e}") from None

    async def restart(self) -> None:
        """Restart ipykernel in its runtime; a dead runtime is created anew
        over the same workspace, so files survive either way."""
        with faults.operation("restart"):
            await self._restart_locked()

    async def _restart_locked(self) -> None:
        self._not_deleted()
        async with self.lock:
            self._not_deleted()  # deleted while this waited
            if self.state in states.WAKES:
                await self._resume()
            in_place = self.state == State.RUNNING and self.link and not self.link.closed.done()
            await self.to(State.RESTARTING)
            # "starting", as a freshly started ipykernel says. Not "restarting": in Jupyter that
            # iopub status means the kernel died and was restarted by the server (jupyter_server
            # sends it only from its auto-restarter), and JupyterLab answers it with a "kernel
            # appears to have died" dialog. A crash still says "restarting" (_on_event).
            self.fanout.broadcast("iopub", status_message("starting"))
            self._fail_pending("the kernel was restarted")
            if in_place:
                try:
                    AGENT_RESTART()
                    await self.link.request("restart", timeout=self.manager.settings.kernel_start_timeout)
                    self.activity = "idle"
                    await self.to(State.RUNNING, reason=None)
                    self.fanout.broadcast("iopub", status_message("idle"))
                    return
                except AgentError as e:
                    log.warning("sandbox %s: in-sandbox restart failed (%s); recreating the runtime", self.id, e)
            await self.teardown()
            try:
                await self.boot()
            except Unavailable as e:
                await self.to(State.DEAD, reason=str(e))
                raise
            await self.to(State.RUNNING, reason=None)
            self.fanout.broadcast("iopub", status_message("idle"))

    async def delete(self) -> None:
        with faults.operation("delete"):
            await self._delete_locked()

    async def _delete_locked(self) -> None:
        async with self.lock:
            if self.state == State.DELETED:
                return  # another DELETE, which this one waited for, did it
            if self.manager.sandboxes.get(self.id) is not self:
                raise NotFound(f"Sandbox does not exist: {self.id}")  # its start failed meanwhile
            frozen = self.state == State.FROZEN
            try:
                # The record goes first: a gateway killed from here on leaves nothing that names
                # this sandbox, and the next one reaps its runtime and files as leftovers
                # (manager.recover), where the record would have brought it back dead.
                await self.to(State.DELETED)
                await self.teardown(frozen=frozen)
            finally:  # files next: a failure here is logged, and the next start sweeps what is left
                try:
                    WORKSPACE_DELETE()
                    await self.ws.delete()
                    WORKSPACE_DELETED()
                except WorkspaceError as e:
                    log.warning("sandbox %s: workspace left behind: %s", self.id, e)
                home = self.manager.settings.home
                for leftover in (home / "sandboxes" / self.id, home / "paused" / self.id):
                    shutil.rmtree(leftover, ignore_errors=True)

    async def detach_runtime(self) -> None:
        """The gateway exits and leaves this sandbox as it is (dead or paused)."""
        if self.link:
            await self.link.close()
            self.link = None
        try:
            await self.ws.detach()
        except WorkspaceError as e:
            log.warning("sandbox %s: workspace left mounted: %s", self.id, e)

    # -- kernel messages -----------------------------------------------------
    def send(self, channel: str, parts: List[bytes], header: dict) -> None:
        """A client's message for the kernel: sent now, held, or refused (Conflict)."""
        st = self.state
        if st in (State.DEAD, State.DELETED):
            raise self._conflict()
        self.last_activity = utcnow()
        if header.get("msg_type") == "execute_request":
            if header.get("msg_id") and not self.executions.accept(header["msg_id"]):
                log.info("sandbox %s: execute_request %s already accepted; not run again", self.id, header["msg_id"])
                return
            self.pending[header.get("msg_id")] = header
            self._sent_at[header.get("msg_id")] = time.monotonic()
        if st == State.RUNNING and self.link:
            try:
                self.link.send_kernel(channel, parts)
            except AgentError as e:
                if e.code == "FrameTooLarge":  # nothing was sent; the stream is fine
                    self.pending.pop(header.get("msg_id"), None)
                    self.executions.forget(header.get("msg_id") or "")
                    raise TooLarge(f"the message is larger than the agent protocol's frame ({e})") from None
                # else the stream just broke: the watcher marks it dead and answers what is pending
            return
        if not self.held.add(channel, parts):
            self.pending.pop(header.get("msg_id"), None)
            self.executions.forget(header.get("msg_id") or "")
            why = (f"the sandbox is {st} and {len(self.held)} messages ({self.held.bytes >> 10} KiB) already wait "
                   f"for it (at most {self.held.max_count} and {self.held.max_bytes >> 20} MiB)")
            log.warning("sandbox %s: refused a %s: %s", self.id, header.get("msg_type"), why)
            if header.get("msg_type") == "execute_request":
                self.fanout.reply("shell", error_reply(header, "SandboxBusy", why))
                self.fanout.broadcast("iopub", status_message("idle", header))
            return
        if st in states.WAKES:
            self._wake()

    def _send_held(self) -> None:
        if not self.held or not self.link:
            return
        try:
            for channel, parts in self.held.take():
                self.link.send_kernel(channel, parts)
        except AgentError:
            pass  # the stream just broke: the watcher marks it dead and answers what is pending

    def _fail_waiting(self, why: str, ename: str = "DeadKernelError") -> None:
        self.held.take()
        self._fail_pending(why, ename)

    def _fail_pending(self, why: str, ename: str = "DeadKernelError") -> None:
        """Answer every execute_request the kernel will never answer, so no
        client waits forever (Kernel Gateway leaves them hanging)."""
        pending, self.pending = self.pending, {}
        self._sent_at.clear()
        for header in pending.values():
            evalue = why if ename != "DeadKernelError" else f"The kernel died while running this cell ({why}); its state is lost"
            self.fanout.reply("shell", error_reply(header, ename, evalue))
            self.fanout.broadcast("iopub", status_message("idle", header))

    def _on_kernel(self, channel: str, parts: List[bytes]) -> None:
        self.last_activity = utcnow()
        if channel == "shell" and self.pending and b"execute_reply" in parts[0]:
            try:
                msg_id = json.loads(parts[1]).get("msg_id")
                self.pending.pop(msg_id, None)
                sent = self._sent_at.pop(msg_id, None)
                if sent is not None:
                    metrics.EXECUTE.labels(self.record.driver).observe(time.monotonic() - sent)
            except (ValueError, AttributeError):
                pass
        if channel == "iopub" and b'"status"' in parts[0]:
            try:
                state = json.loads(parts[3]).get("execution_state")
                # ipykernel's own "starting" can arrive after the agent said
                # ready; starting is the gateway's to say (boot, restart).
                if state and state != "starting" and json.loads(parts[0]).get("msg_type") == "status":
                    self.activity = state
            except (ValueError, AttributeError):
                pass
        self.fanout.route(channel, parts)

    def _on_event(self, ev: P.EventFrame) -> None:
        if ev.event == "kernel_died":
            final = ev.data.get("final")
            log.warning("sandbox %s: ipykernel exited with status %s%s", self.id, ev.data.get("exit_code"),
                        "; giving up: " + ev.data.get("reason", "") if final else "; restarting it")
            self._fail_pending(f"ipykernel exited with status {ev.data.get('exit_code')}")
            if final and self.state == State.RUNNING:
                self.to_now(State.DEAD, reason=ev.data.get("reason") or "ipykernel gave up")
                self.fanout.broadcast("iopub", status_message("dead"))
            else:
                self.activity = "restarting"
                self.fanout.broadcast("iopub", status_message("restarting"))
        elif ev.event == "kernel_restarted":
            log.info("sandbox %s: ipykernel restarted after a crash", self.id)
            self.activity = "idle"
            # The new kernel's own "starting" can be published before the agent's
            # SUB socket reconnects; this one always arrives.
            self.fanout.broadcast("iopub", status_message("idle"))
        elif ev.event == "dropped":
            log.warning("sandbox %s: agent dropped %s messages while detached", self.id, ev.data.get("frames"))

    def attach(self, conn: Listener) -> None:
        self.fanout.attach(conn)

    def detach(self, conn: Listener) -> None:
        self.fanout.detach(conn)

    # -- one cell, for the sandbox API ----------------------------------------
    def _recall_executions(self, cid: str) -> None:
        """The ids a checkpoint knew of (another node's, after a take-over) join this node's."""
        try:
            record = self.manager.checkpoints.get(cid).executions
        except Exception as e:  # the ids are a courtesy; the restore itself decides
            log.warning("sandbox %s: execution ids of checkpoint %s not read: %s", self.id, cid, e)
            return
        for k, v in Executions.from_record(record).finished.items():
            if k not in self.executions.finished:
                self.executions.remember(k, v)

    async def execute(self, code: str, timeout: float,
                      on_output: Optional[Callable[[dict], Awaitable[None]]] = None,
                      execution_id: Optional[str] = None,
                      on_begin: Optional[Callable[[str], Awaitable[None]]] = None) -> dict:
        """Run one cell and return its outputs; on timeout the cell is interrupted. With an
        ``execution_id`` the cell runs at most once: a repeat joins it or gets its result
        (``on_begin`` hears which: Executions.run)."""
        if self.state in states.WAKES:
            await self.resume()  # first: a take-over's resume brings its checkpoint's ids along
        return await self.executions.run(execution_id, lambda emit: self._execute(code, timeout, emit), on_output,
                                         on_begin)

    async def _execute(self, code: str, timeout: float,
                       on_output: Optional[Callable[[dict], Awaitable[None]]] = None) -> dict:
        if self.state in states.WAKES:
            await self.resume()  # a failure to resume is the caller's error, not a cell's
        session, msg_id = uuid.uuid4().hex, uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": "execute_request", "session": session, "username": "sandgate",
                  "date": iso(utcnow()), "version": "5.3"}
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": True}
        parts = [json.dumps(header).encode(), b"{}", b"{}", json.dumps(content).encode()]
        del content
        collector = Collector(session)
        self.fanout.attach(collector)
        outputs, reply, idle, status, paused = [], None, False, "ok", None
        kept, cap, truncated = 0, self.manager.settings.execute_output_mb << 20, False
        try:
            self.send("shell", parts, header)
            # The collector stays attached through a checkpoint, pause and resume: a cell
            # captured by a pause runs on once the sandbox resumes, and its output comes here.
            del parts  # sent (or held, which keeps its own): not kept for the cell's whole run
            deadline = time.monotonic() + timeout
            while not (reply and idle):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if status == "timeout":
                        break  # interrupted, and still no reply: give up waiting
                    status = "timeout"
                    try:
                        await self.interrupt()  # waits for a pause in flight, which interrupts nothing
                    except (Conflict, Unavailable, NotFound):
                        break
                    if self.state in states.WAKES:
                        # Paused with the cell inside: nothing runs to interrupt, and waiting
                        # longer would not end it. Answered now, saying where the cell is.
                        paused = self.record.pause_mode or "disk"
                        break
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
                h = json.loads(got[0])
                if h["msg_type"] == "execute_input":  # the kernel's echo of the code: not parsed a second time
                    continue
                c = json.loads(got[3])
                if channel == "shell" and h["msg_type"] == "execute_reply":
                    reply = c
                elif h["msg_type"] == "status":
                    idle = c.get("execution_state") == "idle"
                else:
                    out = output_of(h["msg_type"], c)
                    if not out:
                        continue
                    kept += len(got[3])
                    if kept > cap:  # the cell runs on; what it says past the cap is not kept
                        if not truncated:
                            truncated = True
                            out = {"type": "stream", "name": "stderr",
                                   "text": f"\n[sandgate: output truncated: this cell wrote more than "
                                           f"{cap >> 20} MiB (SANDGATE_EXECUTE_OUTPUT_MB)]\n"}
                        elif out["type"] != "error":
                            continue
                    outputs.append(out)
                    if on_output:
                        await on_output(out)
        finally:
            self.fanout.detach(collector)
        if reply and status == "ok":
            status = reply.get("status", "ok")
        error = next((o for o in outputs if o["type"] == "error"), None)
        if error is None and reply and reply.get("status") == "error":
            error = output_of("error", reply)  # e.g. DeadKernelError: in the reply only
        if error is None and reply and reply.get("status") == "aborted":
            error = output_of("error", {"ename": "Aborted", "evalue": ABORTED})
        if error is None and paused:
            error = output_of("error", {"ename": "SandboxPaused", "evalue": (
                f"sandbox {self.id} was paused ({'in memory' if paused == 'memory' else 'to disk'}) while this cell "
                f"ran and is still paused at the call's timeout ({timeout:g} s): the cell was not interrupted; it is "
                "kept with the sandbox and runs on when it resumes, its output then going to the kernel's "
                "websocket clients")})
        return {"status": status, "execution_count": (reply or {}).get("execution_count"), "outputs": outputs,
                "stdout": "".join(o["text"] for o in outputs if o["type"] == "stream" and o["name"] == "stdout"),
                "stderr": "".join(o["text"] for o in outputs if o["type"] == "stream" and o["name"] == "stderr"),
                "error": error, "truncated": truncated}


class _Stopped(Exception):
    """A checkpoint failed after the runtime had stopped: the sandbox is gone."""


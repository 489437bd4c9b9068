"""The collection of sandboxes on this node: start, fork, delete, and the
gateway's own restart (suspend everything at exit, recover it at start).

Each sandbox's lifecycle is in core/sandbox.py; warm start in core/pool.py;
background loops in core/culler.py. Front ends do not call this directly:
they call core/service.py, which validates and shapes what they get back.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from sandgate_images import rootfs as images

from .. import faults, metrics
from ..checkpoints import Checkpoint, CheckpointStore, SnapshotLimits
from ..egress.policy import EgressPolicy
from ..egress.secrets import Secret
from ..config import Settings
from ..drivers.base import Driver, Limits, SandboxError
from ..drivers.base import Sandbox as Runtime
from ..kernelspecs import KernelSpecs
from ..workspace import WorkspaceError, reap_mounts
from ..store.base import SessionStore
from . import states
from .errors import Conflict, LimitReached, NotFound, SetupFailed, Unavailable
from .pool import WarmPool
from .record import SandboxRecord
from .messages import utcnow
from .sandbox import Sandbox
from .states import State
from .tunnel import DEFAULT_PORT, EgressHook

log = logging.getLogger("sandgate.manager")

# States whose runtime a killed gateway left is taken over if it still runs: running and frozen
# ones, and those caught mid-operation (the operation never happened: the runtime runs on).
ADOPTABLE = frozenset({State.RUNNING, State.FROZEN, State.CHECKPOINTING, State.PAUSING, State.RESTARTING,
                       State.RESUMING})

# Fault points (faults.py).
point = faults.point
PUT = point("store.starting", "start", "fork", error=OSError)
PUT_DONE = point("store.starting.done", "start", "fork")
DELETE_GC = point("delete.gc", "delete")
GC = point("gc.collect", "gc", error=OSError)
GC_DONE = point("gc.collect.done", "gc")
ADOPT = point("driver.adopt", "recover", error=SandboxError)
ADOPTED = point("driver.adopt.done", "recover")
REAP = point("driver.reap", "recover")
KEEP_IMAGE = point("files.image.keep", "recover", error=OSError)
RECOVERED = point("store.recovered", "recover", error=OSError)
LEFTOVERS = point("files.leftovers", "recover")
DRAIN_STORE = point("store.handed_off", "drain", error=OSError)
DRAIN_STORED = point("store.handed_off.done", "drain")


class SandboxManager:
    def __init__(self, settings: Settings, drivers: Dict[str, Driver], specs: KernelSpecs, store: SessionStore):
        self.settings = settings
        self.drivers = drivers
        self.specs = specs
        self.store = store
        self.sandboxes: Dict[str, Sandbox] = {}
        self._starting = 0
        self._restoring: collections.Counter = collections.Counter()  # checkpoint id -> starts from it in flight
        self._rootfs: Optional[Path] = None
        self._agent_dir: Optional[Path] = None
        where, replica = settings.checkpoint_store, None
        if where.startswith("s3://"):
            from ..checkpoint_replica import S3Replica

            where, replica = "", S3Replica(settings.checkpoint_store)
        self.checkpoints = CheckpointStore(Path(where) if where else settings.home / "checkpoints", SnapshotLimits(
            max_bytes=settings.checkpoint_max_bytes, max_new_bytes=settings.checkpoint_max_new_bytes,
            max_files=settings.checkpoint_max_files), shared=bool(settings.checkpoint_store), replica=replica,
            kept_bytes=settings.kept_images_mb << 20)
        self.pool = WarmPool(self)
        self.stopping = False  # set by suspend_all: nothing wakes up any more
        self.egress: Optional[EgressHook] = None  # the egress proxy, once one runs (core/tunnel.py)

    def rootfs(self) -> Path:
        if self._rootfs is None:
            if not images.is_built(self.settings.home):
                raise Unavailable("the sandbox image is not built: run `sandgate image build`")
            self._rootfs = images.image_dir(self.settings.home) / "rootfs"
        return self._rootfs

    def agent_dir(self) -> Path:
        if self._agent_dir is None:
            self._agent_dir = images.agent_bundle(self.settings.home)
        return self._agent_dir

    def get(self, sandbox_id: str) -> Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise NotFound(f"Sandbox does not exist: {sandbox_id}")
        return sb

    def list(self) -> List[Sandbox]:
        return list(self.sandboxes.values())

    # -- start, fork, delete ---------------------------------------------------
    async def start(self, kernel_name: str, driver: str, env: Dict[str, str], limits: Limits,
                    labels: Optional[Dict[str, str]] = None, ttl: Optional[float] = None,
                    checkpoint: Optional[Checkpoint] = None, owner: str = "",
                    sandbox_id: Optional[str] = None, egress: Optional[EgressPolicy] = None,
                    secrets: Sequence[Secret] = ()) -> Sandbox:
        """Start a sandbox cold, from the warm pool, from the template, or
        from a checkpoint (files and running state). Arguments are validated;
        ``sandbox_id`` (a new uuid4 when omitted) lets the service count it
        against its owner's quota before it exists."""
        with faults.operation("fork" if checkpoint is not None else "start"):
            return await self._start(kernel_name, driver, env, limits, labels, ttl, checkpoint, owner, sandbox_id,
                                     egress, secrets)

    async def _start(self, kernel_name, driver, env, limits, labels, ttl, checkpoint, owner, sandbox_id, egress,
                     secrets) -> Sandbox:
        if self.stopping:
            raise Unavailable("the gateway is shutting down")
        if egress is not None and self.egress is None:
            raise Unavailable("this gateway has no egress proxy: sandboxes here have no network")
        if len(self.sandboxes) + self._starting >= self.settings.max_kernels:
            raise LimitReached(f"Maximum number of sandboxes ({self.settings.max_kernels}) reached")
        asked = checkpoint.id if checkpoint is not None else None
        if asked:  # deleted since the caller read it? (delete_checkpoint checks _restoring)
            if not (self.checkpoints.items / asked / "checkpoint.json").is_file():
                raise NotFound(f"No such checkpoint: {asked}")
        rec = SandboxRecord(id=sandbox_id or str(uuid.uuid4()), owner=owner, kernel_name=kernel_name, driver=driver, env=env,
                            limits=limits, labels=labels or {}, node=self.store.node,
                            expires=time.time() + ttl if ttl else None, egress=egress, secrets=list(secrets),
                            egress_port=DEFAULT_PORT if egress is not None else None)
        self._starting += 1
        if asked:
            self._restoring[asked] += 1
        sb: Optional[Sandbox] = None
        how = "cold"
        try:
            default_limits = limits == self.settings.limits
            pooled = None if checkpoint or not default_limits else self.pool.take(driver)
            if pooled:  # warm, already running: the start costs one setup call
                sb, how = pooled, "from the warm pool"
                # Already running: its new record starts as running.
                sb.record = rec.model_copy(update={"state": State.RUNNING, "runtime": pooled.record.runtime})
                sb.fanout.sandbox_id = rec.id
                sb.persistent = True
                await sb.ws.rename(rec.id)
                sb.runtime.spec.workspace = sb.workspace
                sb.fanout.clear()
                sb.last_activity = utcnow()  # its time in the pool is not idle time
                await sb.setup(env)
                sb.publish_egress()
                if sb.record.egress_port:
                    await sb._apply_egress()
                log.info("sandbox %s: running (taken from the pool as %s)", rec.id, pooled.id)
                self.sandboxes[sb.id] = sb
                sb._stored = State.STARTING  # not in the store yet: put below
                await self.store.put(sb.record)
                sb._stored = State.RUNNING
            else:
                if checkpoint is None and default_limits:
                    checkpoint = self.pool.ready_template(driver)  # None until the template is made
                if checkpoint and not self.pool.is_template(checkpoint.id):
                    rec.origin = rec.head = checkpoint.id
                    rec.parent = checkpoint.sandbox
                sb = Sandbox(self, rec)
                PUT()
                sb.record = await self.store.put(rec)
                PUT_DONE()
                self.sandboxes[sb.id] = sb
                sb.publish_egress()  # before it runs: its first connection finds its policy
                async with sb.lock:
                    if checkpoint:
                        how = f"from checkpoint {checkpoint.id}"
                        await sb.fill_workspace(checkpoint)
                        try:
                            await sb.boot_checkpoint(checkpoint.id, setup_env=env)
                        except SetupFailed:
                            raise  # this sandbox's environment, not the checkpoint: a template is kept
                        except Unavailable as e:
                            if not self.pool.is_template(checkpoint.id):
                                raise
                            # A template that does not restore would fail every start: forget it
                            # (a new one is made later) and start this one cold.
                            self.pool.template_failed(driver, checkpoint.id, e)
                            how, checkpoint = "cold: the warm-start template did not restore", None
                            await sb.boot()
                    else:
                        await sb.boot()
                    await sb.to(State.RUNNING)
        except BaseException:
            if sb is not None:
                self.sandboxes.pop(sb.id, None)
                if self.egress:
                    self.egress.forget(sb.id)
                await sb.teardown()
                await sb.ws.delete()
                await self.store.delete(sb.id)
            raise
        finally:
            self._starting -= 1
            if asked:
                self._restoring[asked] -= 1
                if self._restoring[asked] <= 0:
                    del self._restoring[asked]
        log.info("sandbox %s started (%s, runtime %s, %s)", sb.id, driver, sb.record.runtime, how)
        path = "pool" if how.endswith("pool") else "cold" if not checkpoint else (
            "template" if self.pool.is_template(checkpoint.id) else "checkpoint")
        metrics.STARTS.labels(driver, path).inc()
        self.pool.refill(driver)
        return sb

    async def delete(self, sandbox_id: str) -> None:
        sb = self.get(sandbox_id)
        await sb.delete()
        self.sandboxes.pop(sandbox_id, None)
        # Its Jupyter sessions go with it (a deleted or culled kernel; readers
        # also drop a session whose kernel is gone or dead, e.g. on a lost node).
        for ns in await self.store.list_sessions(sb.record.owner):
            if ns.kernel_id == sandbox_id:
                await self.store.delete_session(ns.id)
        if self.egress:
            self.egress.forget(sandbox_id)
        with faults.operation("delete"):
            DELETE_GC()
        await self.gc()
        log.info("sandbox %s deleted", sandbox_id)

    async def gc(self) -> int:
        """Checkpoints no live sandbox's line needs, and their blobs (off the loop).
        A shared checkpoint store counts every node's sandboxes, from the store."""
        records = await self.store.list() if self.checkpoints.shared else [sb.record for sb in self.sandboxes.values()]
        live = set(self.sandboxes) | {r.id for r in records}
        keep = {c for r in records for c in (r.origin, r.resume_from, r.head) if c}
        with faults.operation("gc"):
            GC()
            n = await self.checkpoints.gc_async(live, keep | set(self.pool.templates.values()))
            GC_DONE()
        return n

    async def delete_checkpoint(self, cid: str) -> int:
        """Delete checkpoint ``cid``, or Conflict naming what still needs it; what only it held
        (blobs, chunks) is collected, what other checkpoints share is kept. Returns how many files
        the collection removed."""
        records = await self.store.list() if self.checkpoints.shared else None
        # From the check to the record's removal nothing awaits: no start from it begins meanwhile.
        try:
            cp = self.checkpoints.get(cid)
        except (KeyError, ValueError, OSError):
            raise NotFound(f"No such checkpoint: {cid}") from None
        why = self.needed_by(cp, records)
        if why:
            raise Conflict(f"checkpoint {cid} cannot be deleted: {'; '.join(why)}", code="in_use")
        self.checkpoints.unlist(cid)
        removed = await asyncio.to_thread(self.checkpoints.remove, cp)
        if self.checkpoints.replica is not None:
            try:
                await asyncio.to_thread(self.checkpoints.replica.delete, cid)
            except Exception as e:
                log.warning("checkpoint %s left in the replica: %s", cid, e)
        log.info("checkpoint %s deleted (%d unused files collected)", cid, removed)
        return removed

    def needed_by(self, cp: Checkpoint, records=None) -> List[str]:
        """What keeps checkpoint ``cp`` from being deleted, in words (empty: nothing). ``records``:
        every node's sandboxes (a shared store), else this node's."""
        cid, why = cp.id, []
        if cid in self.pool.templates.values():
            why.append("it is the warm pool's template")
        if self._restoring.get(cid):
            why.append("a sandbox is being started from it")
        if records is None:
            records = [sb.record for sb in self.sandboxes.values()]
        drivers = {r.id: r.driver for r in records}
        for r in records:
            if r.resume_from == cid:
                why.append(f"sandbox {r.id} resumes from it ({r.state})")
            if r.origin == cid:
                why.append(f"sandbox {r.id} was forked from it")
            if r.head == cid:
                why.append(f"it is sandbox {r.id}'s newest checkpoint, the one it resumes from if its runtime is "
                           "lost; take a newer one first")
        for child in self.checkpoints.list():
            driver = child.driver or drivers.get(child.sandbox) or cp.driver
            layered = self.drivers[driver].layered_checkpoints if driver in self.drivers else True  # unknown: it may be
            if child.parent == cid and layered:
                why.append(f"checkpoint {child.id} is layered on it (its {driver or 'unknown'} disks)")
        return why

    # -- the gateway's own restart -----------------------------------------------
    async def recover(self) -> None:
        """At start: read this node's records back. Paused and dead sandboxes
        come back as they were. One the last gateway left running or frozen, or
        caught mid-operation (it was killed), is adopted, runtime and all, where its
        driver can; failing that it resumes from the running-state image the operation
        had finished, else from its newest checkpoint, or is dead if it has none. A
        start nobody was answered is forgotten. Then what no record claims is removed."""
        with faults.operation("recover"):
            await self._recover()

    async def _recover(self) -> None:
        records = []
        for rec in await self.store.list(node=self.store.node):
            if rec.state == State.STARTING:
                # Its start was never answered, so no client knows of it: gone, as a failed start is
                # (its runtime is reaped and its files removed below, with the other leftovers).
                await self.store.delete(rec.id)
                log.warning("sandbox %s: forgotten: the gateway stopped while it was starting", rec.id)
                continue
            records.append(rec)
        adopted: Dict[str, Runtime] = {}
        for rec in records:
            if rec.state in ADOPTABLE and rec.runtime and rec.driver in self.drivers:
                driver = self.drivers[rec.driver]
                try:
                    await driver.settle(rec.runtime)  # a checkpoint the dead gateway started ends first
                    ADOPT()
                    adopted[rec.id] = await driver.adopt(rec.runtime)
                    ADOPTED()
                except SandboxError as e:
                    log.warning("sandbox %s: runtime %s not adopted: %s", rec.id, rec.runtime, e)
        REAP()
        for name, driver in self.drivers.items():
            n = await driver.reap(keep=[adopted[r.id].id for r in records if r.id in adopted and r.driver == name])
            if n:
                log.warning("removed %d %s sandboxes left running by an earlier gateway process", n, name)
        for rec in records:
            runtime = adopted.get(rec.id)
            if rec.driver not in self.drivers:
                rec = rec.model_copy(update={"state": State.DEAD, "reason": f"driver {rec.driver} is not available"})
            elif runtime:
                pass
            elif rec.state in (State.CHECKPOINTING, State.PAUSING) and self._image_whole(rec):
                rec = self._keep_image(rec)
            elif rec.state == State.PAUSED and rec.paused_image and not Path(rec.paused_image).is_dir():
                rec = self._lost(rec, "its paused state is missing from disk")
            elif rec.state == State.RESUMING and self._resumes_again(rec):
                # Killed mid-resume: what it was resuming from is whole (the image goes only
                # once the record says running), so it is paused again, as a failed resume is.
                rec = rec.model_copy(update={"state": State.PAUSED})
            elif rec.state not in states.AT_REST:
                rec = self._lost(rec, f"the gateway stopped while it was {rec.state}")
            if not runtime:
                rec = rec.model_copy(update={"runtime": None})
            if rec.state != State.PAUSED:
                rec = rec.model_copy(update={"paused_image": None})
            sb = Sandbox(self, rec)
            try:
                await sb.ws.attach()
                if runtime:
                    was = rec.state
                    await sb.adopt(runtime)
                    if was not in (State.RUNNING, State.FROZEN):  # the operation it was in never happened
                        sb.record = rec = rec.model_copy(update={"state": State.RUNNING, "pause_mode": None})
                    log.info("sandbox %s: adopted its %s runtime %s", sb.id, was, runtime.id)
            except (WorkspaceError, Unavailable) as e:
                if runtime:
                    await runtime.destroy()
                    sb.record = rec = self._lost(rec, f"its runtime was left running but could not be adopted ({e})")
                elif rec.state != State.DEAD:
                    sb.record = rec = rec.model_copy(update={"state": State.DEAD, "reason": f"lost: {e}"})
            RECOVERED()
            sb.record = await self.store.put(rec)
            sb._stored = rec.state
            self.sandboxes[sb.id] = sb
            sb.publish_egress()
            log.info("sandbox %s recovered: %s%s", sb.id, rec.state, f" ({rec.reason})" if rec.reason else "")
        # Checkpoints a crash interrupted, now that an image one of them held has been kept.
        await asyncio.to_thread(self.checkpoints.sweep)
        # The state directories of adopted runtimes started as pooled sandboxes have the pool's names.
        keep = set(self.sandboxes) | {rt.spec.state_dir.name for rt in adopted.values()}
        # A paused image is kept only for a record that resumes from it.
        images = {sb.id for sb in self.sandboxes.values() if sb.state == State.PAUSED and sb.record.paused_image}
        home = self.settings.home
        LEFTOVERS()
        await reap_mounts(home / "workspaces", keep=self.sandboxes)
        orphans = 0
        for leftover, kept in (("sandboxes", keep), ("workspaces", keep), ("paused", images)):
            d = home / leftover
            if d.is_dir():
                for p in d.iterdir():
                    if p.name.removesuffix(".img") not in kept:
                        orphans += leftover != "paused"
                        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if orphans:  # a delete (or a start) the last gateway did not finish: its checkpoints go too
            await self.gc()

    def _image_whole(self, rec: SandboxRecord) -> bool:
        """Whether a record left checkpointing or pausing names a running-state image its
        driver finished writing (the runtime it was taken from is gone)."""
        return bool(rec.paused_image) and rec.driver in self.drivers and \
            self.drivers[rec.driver].image_whole(Path(rec.paused_image))

    def _keep_image(self, rec: SandboxRecord) -> SandboxRecord:
        """Killed after its checkpoint or pause to disk had stopped the runtime into a whole
        image: paused, resuming from that image with its memory. One inside an unfinished
        checkpoint moves to ``paused/<id>/`` first (that checkpoint was never answered, and
        the sweep removes it)."""
        image, paused = Path(rec.paused_image), self.settings.home / "paused" / rec.id
        try:
            if image != paused:
                shutil.rmtree(paused, ignore_errors=True)
                paused.parent.mkdir(parents=True, exist_ok=True)
                KEEP_IMAGE()
                os.rename(image, paused)
        except OSError as e:
            log.warning("sandbox %s: the running-state image its %s took is lost: %s", rec.id, rec.state, e)
            return self._lost(rec, f"the gateway stopped while it was {rec.state} and its image could not be kept")
        return rec.model_copy(update={
            "state": State.PAUSED, "pause_mode": "disk", "paused_image": str(paused),
            "reason": None if rec.state == State.PAUSING else
            f"the gateway stopped while it was {rec.state}: it resumes from the running state saved then, "
            "memory whole; that checkpoint was not kept"})

    def _resumes_again(self, rec: SandboxRecord) -> bool:
        """Whether a record left resuming still has what it resumed from: its paused
        image, or (no image) the checkpoint it resumes from."""
        if rec.paused_image:
            return Path(rec.paused_image).is_dir()
        if rec.resume_from:
            try:
                self.checkpoints.get(rec.resume_from)
                return True
            except (KeyError, ValueError, OSError):
                return False
        return False

    async def hand_off(self, sb: Sandbox) -> Optional[str]:
        """Drain one sandbox off this node: checkpoint it into the shared store
        (a paused or frozen one is resumed for that), stop it here, and leave
        its record to whichever node is asked for it next (Fleet.locate).
        Returns the checkpoint's id (None for a dead one, handed off as it is)."""
        with faults.operation("drain"):
            return await self._hand_off(sb)

    async def _hand_off(self, sb: Sandbox) -> Optional[str]:
        cid = None
        update = {"node": "", "runtime": None}
        if sb.state != State.DEAD:
            cid = (await sb.checkpoint("drain", resume=False)).id
            update.update(state=State.PAUSED, pause_mode="disk", paused_image=None, resume_from=cid,
                          reason=f"moved off node {self.store.node} by a drain: it resumes from checkpoint {cid}")
        DRAIN_STORE()
        await self.store.put(sb.record.model_copy(update=update))
        DRAIN_STORED()
        self.sandboxes.pop(sb.id, None)
        if self.egress:
            self.egress.forget(sb.id)
        await sb.ws.delete()  # its files are in the checkpoint
        log.info("sandbox %s handed off%s", sb.id, f" at checkpoint {cid}" if cid else " (dead)")
        return cid

    async def take_over(self, rec: SandboxRecord, why: str) -> Sandbox:
        """A sandbox of a node that stopped answering, made this node's: back from
        its newest checkpoint (in the shared store) on first use, or dead if it
        has none. The store's compare-and-set makes one node the winner."""
        for cid in {rec.head, rec.resume_from} - {None}:  # another node's checkpoints, from the replica
            await asyncio.to_thread(self.checkpoints.fetch, cid)
        if rec.node == "" and rec.state == State.PAUSED and rec.resume_from:  # drained: nothing was lost
            new = rec.model_copy(update={"node": self.store.node})
        else:
            new = self._lost(rec, why).model_copy(update={"node": self.store.node, "runtime": None})
        if not await self.store.compare_and_set(new, rec.state):
            raise Unavailable(f"sandbox {rec.id} is being taken over by another node; try again")
        sb = Sandbox(self, new)
        sb._stored = new.state
        if new.resume_from and sb.driver.shares_workspace:
            await sb.fill_workspace(self.checkpoints.get(new.resume_from))  # the files, as at the checkpoint
        else:
            await sb.ws.create()  # a VM's disk comes with its checkpoint; a dead one restarts empty
        self.sandboxes[sb.id] = sb
        sb.publish_egress()
        log.warning("sandbox %s taken over from node %s: %s", sb.id, rec.node, new.reason)
        return sb

    def _lost(self, rec: SandboxRecord, why: str) -> SandboxRecord:
        """A sandbox whose running state is gone: back from its newest
        checkpoint on first use if it has one (said in ``reason``), else dead."""
        head = rec.head
        if head:
            try:
                cp = self.checkpoints.get(head)
            except KeyError:
                head = None
        if not head:
            return rec.model_copy(update={"state": State.DEAD, "reason": f"lost: {why}, and it has no checkpoint"})
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(cp.created))
        return rec.model_copy(update={
            "state": State.PAUSED, "pause_mode": "disk", "paused_image": None, "resume_from": head,
            "reason": f"{why}: it resumes from checkpoint {head} taken at {when}; later changes to its memory are lost"})

    async def suspend_all(self) -> None:
        """At exit: pause every running sandbox to disk (a few at a time, with
        progress in the log) so the next gateway resumes them; then let go."""
        self.stopping = True
        await self.pool.close()
        running = [sb for sb in self.sandboxes.values() if sb.state not in (State.PAUSED, State.DEAD)]
        total, done = len(running), 0
        if total:
            log.info("pausing %d sandboxes to disk before exit (%d at a time)", total, self.settings.shutdown_parallel)
        gate = asyncio.Semaphore(self.settings.shutdown_parallel)

        async def one(sb: Sandbox) -> None:
            nonlocal done
            async with gate:
                t0 = time.monotonic()
                if sb.state == State.DELETED or sb.id not in self.sandboxes:
                    done += 1
                    return  # deleted by a request still in flight
                try:
                    await sb.pause("disk", shutdown=True)
                    outcome = f"paused in {time.monotonic() - t0:.1f} s"
                except Exception as e:
                    if sb.state == State.DELETED:
                        done += 1
                        return  # deleted while it waited for the pause: nothing to keep
                    outcome = f"could not be paused ({e}); " + (
                        f"it will resume from checkpoint {sb.record.head}" if sb.record.head else "it is lost")
                    if sb.state != State.DEAD:
                        await sb.teardown()
                    rec = self._lost(sb.record, f"it could not be paused when the gateway stopped: {e}")
                    sb.record = await self.store.put(rec)
                done += 1
                log.info("shutdown: %d/%d: sandbox %s %s", done, total, sb.id, outcome)

        await asyncio.gather(*(one(sb) for sb in running))
        for sb in list(self.sandboxes.values()):
            await sb.detach_runtime()

    async def delete_all(self) -> None:
        """Remove every sandbox (tests, and `serve --no-keep`)."""
        await self.pool.close()
        await asyncio.gather(*(self.delete(i) for i in list(self.sandboxes)), return_exceptions=True)

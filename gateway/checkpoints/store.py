"""``CheckpointStore``: what the lifecycle calls to take, list, restore, delete and collect
checkpoints, each job done by a collaborator that owns its state: the records (``Catalog``), the
workspace blobs (``BlobStore``), the running-state chunks (``ChunkStore``), the kept assembled
images (``ImageCache``), what a sweep must leave (``Pins``), and an optional replica in a bucket.

Every method may run in a worker thread (``snapshot_async``, ``materialize_async``, ``gc_async``),
concurrently for different workspaces."""

from __future__ import annotations

import asyncio
import logging
import shutil
import stat
import threading
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from .blobs import BlobStore
from .catalog import Catalog
from .images import ImageCache
from .pins import SHARED_GRACE, Pins
from .records import Checkpoint, FileEntry, SnapshotLimits, StoreQuota, blob_key
from .sparse import data_bytes, dir_size, stored_bytes, tree
from .state_chunks import ChunkStore, manifest_keys

log = logging.getLogger("sandgate.checkpoints")


class CheckpointStore:
    def __init__(self, root: Path, limits: Optional[SnapshotLimits] = None, shared: bool = False, replica=None,
                 kept_bytes: int = 0):
        self.root = root
        self.shared = shared  # other nodes read (and, but for a replica, write) these checkpoints too
        self.replica = replica  # an S3Replica (replica.py): each commit is copied there
        self.pins = Pins(shared)
        self.catalog = Catalog(root / "items")
        self.items = self.catalog.items
        self.blobs = BlobStore(root / "blobs", self.catalog, self.pins, limits or SnapshotLimits())
        self.chunks = ChunkStore(root / "chunks")  # running-state images, chunked (state_chunks.py)
        self.images = ImageCache(root, self.catalog, self.chunks, kept_bytes, shared)

    # -- taking one ----------------------------------------------------------

    def new_dir(self) -> tuple[str, Path]:
        return self.new_dir_for(uuid.uuid4().hex[:12])

    def new_dir_for(self, cid: str) -> tuple[str, Path]:
        """An unfinished checkpoint's directory (sweep leaves it while this process has it open)."""
        with self.pins.lock:
            self.pins.open(cid)
            path = self.catalog.make_dir(cid)
        return cid, path

    def state_dir(self, cid: str) -> Path:
        return self.catalog.state_dir(cid)

    def store_state(self, cid: str, owner: str, names) -> Tuple[int, int]:
        """Replace the image files ``names`` in the state directory of the
        unfinished checkpoint ``cid`` by chunks (state_chunks.py), pinned until
        it is committed or discarded. Returns the state's size (the whole
        directory, as the driver wrote it) and the bytes it added to storage."""
        state = self.state_dir(cid)
        total = dir_size(state)
        whole = total - sum((state / n).stat().st_size for n in names if (state / n).is_file())

        _, added, _ = self.chunks.put_image(state, names, owner, lambda keys: self.pin(cid, keys))
        return total, whole + added

    def pin(self, cid: str, keys) -> None:
        """Keep ``keys`` (chunks or blobs) from a sweep until the unfinished checkpoint ``cid`` is
        committed (its record names them from then on) or discarded."""
        if not self.pins.pin(cid, keys, cid):
            raise RuntimeError(f"checkpoint {cid} was discarded while it was being stored")

    def snapshot(self, workspace: Path, limits: Optional[SnapshotLimits] = None, *, cid: Optional[str] = None,
                 cancel: Optional[threading.Event] = None, owner: str = "",
                 quota: Optional[StoreQuota] = None) -> tuple[Dict[str, FileEntry], int]:
        """The workspace's files stored as blobs (``BlobStore.snapshot``)."""
        return self.blobs.snapshot(workspace, limits, cid=cid, cancel=cancel, owner=owner, quota=quota)

    def commit(self, cp: Checkpoint, replicate: bool = True) -> None:
        """Make ``cp`` whole (its record, written last); then copy it to the replica, if any. A
        failed copy is logged: the checkpoint stands here, but another node cannot restore it."""
        self._commit_here(cp)
        if self.replica is not None and replicate:
            try:
                self.replica.upload(self, cp)
            except Exception as e:
                log.warning("checkpoint %s not copied to the replica (other nodes cannot restore it): %s", cp.id, e)

    def _commit_here(self, cp: Checkpoint) -> None:
        self.catalog.write(cp)
        self._close(cp.id)  # the record keeps its blobs from here on

    def _close(self, cid: str) -> None:
        self.pins.close(cid)

    # -- reading ---------------------------------------------------------------

    def get(self, cid: str) -> Checkpoint:
        return self.catalog.get(cid)

    def list(self, sandbox: Optional[str] = None, owner: Optional[str] = None) -> List[Checkpoint]:
        """Committed checkpoints, oldest first; of one sandbox, of one owner."""
        return self.catalog.list(sandbox, owner)

    def fetch(self, cid: str) -> Optional[Checkpoint]:
        """``cid`` from the replica when this node does not have it (another node took it)."""
        if self.replica is None:
            return None
        try:
            self.get(cid)
            return None
        except KeyError:
            return self.replica.fetch(self, cid)

    def usage(self, owner: str) -> int:
        """Bytes ``owner``'s committed checkpoints hold: each of its blobs and state chunks once,
        however many of its checkpoints share it (another owner's are never its: the keys differ),
        plus the state files kept whole. Data bytes (a sparse blob's holes are free); kept
        assembled images are a cache that gives way to checkpoints, not counted."""
        blobs: Set[str] = set()
        chunks: Set[str] = set()
        total = 0
        for cp in self.list(owner=owner):
            blobs.update(blob_key(owner, e.sha256) for e in cp.files.values())
            state = self.state_dir(cp.id)
            try:
                chunks.update(manifest_keys(state))
            except ValueError:
                pass  # a damaged manifest: its whole files are still counted below
            total += sum(data_bytes(st) for st in tree(state) if stat.S_ISREG(st.st_mode))
        return total + stored_bytes([*(self.blobs.path(k) for k in blobs), *(self.chunks.path(k) for k in chunks)])

    def materialize(self, cp: Checkpoint, dest: Path, uid: Optional[int] = None,
                    cancel: Optional[threading.Event] = None) -> None:
        """The checkpoint's workspace written into ``dest`` (``BlobStore.materialize``)."""
        self.blobs.materialize(cp, dest, uid, cancel)

    def restorable(self, cid: str, move: bool = False, keep: bool = False):
        """A directory holding ``cid``'s state image as its driver wrote it (``ImageCache.restorable``)."""
        return self.images.restorable(cid, move, keep)

    def assemble_ahead(self, cid: str, protect=()) -> Optional[asyncio.Future]:
        """``cid``'s image assembled and kept ahead of its next restore (``ImageCache.assemble_ahead``)."""
        return self.images.assemble_ahead(cid, protect)

    def evict_kept(self, protect=(), spare: str = "") -> int:
        """Kept images dropped down to their budget (``ImageCache.evict_kept``)."""
        return self.images.evict_kept(protect, spare)

    # -- deleting and collecting -----------------------------------------------

    def unlist(self, cid: str) -> Checkpoint:
        """The first step of deleting committed checkpoint ``cid`` (the caller checked that nothing
        needs it): its record goes, so from now on it is not listed, restored or forked. Then
        ``remove``."""
        return self.catalog.unlist(cid)

    def remove(self, cp: Checkpoint) -> int:
        """The rest of deleting ``cp`` after ``unlist``: its children are re-parented to its parent
        (the tree stays connected), its directory goes, and a sweep removes the blobs and chunks
        nothing else uses; what another checkpoint shares stays. Returns what the sweep removed."""
        for child in self.list():
            if child.parent == cp.id:
                self._commit_here(child.model_copy(update={"parent": cp.parent}))
        self.discard(cp.id)
        return self.sweep()

    def discard(self, cid: str) -> None:
        self._close(cid)
        self.catalog.remove_dir(cid)
        self.images.forget(cid)

    def sweep(self) -> int:
        """Remove unfinished checkpoints (no record, none open in this
        process), blobs no record and no unfinished snapshot uses, and
        leftover temporary blobs."""
        removed = 0
        with self.pins.lock:
            for d in self.catalog.unfinished(self.pins.is_open, self.pins.old):
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
            removed += self.blobs.sweep()
            removed += self.chunks.sweep(self._live_chunks(), self.pins.old)
            self.images.sweep(SHARED_GRACE)
        return removed

    def _live_chunks(self) -> Set[str]:  # under pins.lock
        live: Set[str] = set()
        for d in self.items.iterdir():
            if self.catalog.has_record(d) or self.pins.is_open(d.name):
                try:
                    live.update(manifest_keys(d / "state"))
                except ValueError as e:  # a damaged manifest keeps nothing; say so
                    log.warning("checkpoint %s: %s", d.name, e)
        return live | self.pins.pinned()

    def gc(self, keep_sandboxes: set, keep_checkpoints: set) -> int:
        """Drop checkpoints that no branch references: not taken from a live
        sandbox, not the origin of one, not an ancestor of either; then blobs."""
        cps = {c.id: c for c in self.list()}
        keep = {c.id for c in cps.values() if c.sandbox in keep_sandboxes} | (keep_checkpoints & set(cps))
        frontier = list(keep)
        while frontier:  # ancestors of kept checkpoints stay: they are the tree
            parent = cps[frontier.pop()].parent
            if parent in cps and parent not in keep:
                keep.add(parent)
                frontier.append(parent)
        dropped = [cid for cid in cps if cid not in keep]
        for cid in dropped:
            self.discard(cid)
            if self.replica is not None:
                try:
                    self.replica.delete(cid)
                except Exception as e:
                    log.warning("checkpoint %s left in the replica: %s", cid, e)
        return len(dropped) + self.sweep()

    # -- off the event loop -----------------------------------------------

    async def snapshot_async(self, workspace: Path, limits: Optional[SnapshotLimits] = None, *,
                             cid: Optional[str] = None, owner: str = "",
                             quota: Optional[StoreQuota] = None) -> tuple[Dict[str, FileEntry], int]:
        """``snapshot`` in a worker thread. Cancelling stops it at the next
        chunk, removes what it wrote, and returns only once the thread is done."""
        return await _in_thread(self.snapshot, workspace, limits, cid=cid, owner=owner, quota=quota)

    async def materialize_async(self, cp: Checkpoint, dest: Path, uid: Optional[int] = None) -> None:
        """``materialize`` in a worker thread; cancelling stops it at the next
        chunk (``dest`` is left partial, for the caller to remove) and returns
        once the thread is done."""
        return await _in_thread(self.materialize, cp, dest, uid)

    async def gc_async(self, keep_sandboxes: set, keep_checkpoints: set) -> int:
        """``gc`` in a worker thread."""
        return await asyncio.to_thread(self.gc, keep_sandboxes, keep_checkpoints)


async def _in_thread(fn, *args, **kwargs):
    cancel = threading.Event()
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args, cancel=cancel, **kwargs))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        cancel.set()
        while not fut.done():  # the caller's cleanup must not race the thread
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                pass
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller sees
        raise

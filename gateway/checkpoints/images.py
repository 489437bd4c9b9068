"""Running-state images assembled from their chunks (state_chunks.py) for a restore, and those
kept assembled (``items/<cid>/assembled``) so a checkpoint restored again and again (a template, a
fork's source) is not assembled on every restore's critical path. Kept images are a cache: at most
``kept_bytes`` of them besides templates', and they give way while the disk is short of space."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, Optional, Set, Tuple

from .catalog import Catalog
from .sparse import dir_size
from .state_chunks import MANIFEST as STATE_MANIFEST, ChunkStore, assembled_size

ASSEMBLED = "assembled"  # a checkpoint's images assembled from their chunks, kept (ImageCache.restorable)
KEEP_FREE = 1 << 30  # ImageCache.keep_free: kept images give way below this much free disk

log = logging.getLogger("sandgate.checkpoints")


class ImageCache:
    def __init__(self, root: Path, catalog: Catalog, chunks: ChunkStore, kept_bytes: int = 0, shared: bool = False):
        self.root = root  # restores assemble their images under root/restoring
        self.catalog, self.chunks = catalog, chunks
        self.items = catalog.items
        self.shared = shared
        self._lock = threading.Lock()
        self._assembling: Dict[str, threading.Lock] = {}  # cid -> held while its kept image is assembled
        # Kept images of checkpoints other than templates (assemble_ahead): at most this many bytes,
        # least recently restored dropped first; none for a store other nodes share (one node's
        # eviction would pull an image from under another's restore).
        self.kept_bytes = 0 if shared else kept_bytes
        # ... and they give way to checkpoints: none is made, and the oldest go, while the disk has
        # less than this free (a checkpoint refused for want of space would cost more than a fork's time).
        self.keep_free = KEEP_FREE
        self._ahead: Set[str] = set()  # cids whose image is being assembled ahead: a restore waits for it
        self._in_use: collections.Counter = collections.Counter()  # cid -> restores reading its kept image now
        self._queue: collections.deque = collections.deque()  # assemble_ahead's (cid, protect, done), in order
        self._runner: Optional[asyncio.Future] = None

    @contextlib.asynccontextmanager
    async def restorable(self, cid: str, move: bool = False, keep: bool = False):
        """A directory holding checkpoint ``cid``'s state image as its driver
        wrote it: the state directory itself for a whole image; else a new one
        (removed afterwards) with the images assembled from their chunks and
        the other files linked (``move``: moved, for a restore that consumes
        them; the checkpoint is discarded after). ``keep``: for a checkpoint
        restored again and again (a template), the images are assembled once
        and kept beside its state (``assembled/``) for every later restore."""
        state = self.catalog.state_dir(cid)
        if not (state / STATE_MANIFEST).is_file():
            yield state
            return
        if not move and (keep or self._kept_or_coming(cid)):
            t0 = time.monotonic()
            taking = asyncio.ensure_future(asyncio.to_thread(self._assembled, cid, True))
            try:
                kept = await asyncio.shield(taking)
            except asyncio.CancelledError:  # the thread goes on and takes a hold: let go of it then
                taking.add_done_callback(lambda f: f.cancelled() or f.exception() or self._release(cid))
                raise
            try:
                log.info("checkpoint %s: assembled image %s in %.0f ms", cid, "kept" if kept[1] else "built and kept",
                         (time.monotonic() - t0) * 1000)
                yield kept[0]
            finally:
                self._release(cid)
            return
        work = self.root / "restoring" / uuid.uuid4().hex[:12]

        def build():
            work.mkdir(parents=True)
            for p in state.iterdir():
                if p.name != STATE_MANIFEST:
                    if move:
                        shutil.move(str(p), work / p.name)
                    else:
                        (work / p.name).symlink_to(p.resolve())
            self.chunks.assemble(state, work)

        try:
            t0 = time.monotonic()
            await asyncio.to_thread(build)
            log.info("checkpoint %s: image assembled in %.0f ms", cid, (time.monotonic() - t0) * 1000)
            yield work
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    def _assembled(self, cid: str, use: bool = False) -> Tuple[Path, bool]:
        """Checkpoint ``cid``'s images assembled in ``items/<cid>/assembled`` (built under a
        temporary name and renamed, so one that exists is whole), and whether it was there
        already. It goes with the checkpoint's directory; it is a copy of what its chunks hold,
        so no record's ``stored_bytes`` counts it (about ``state_bytes``, uncompressed).
        ``use``: for a restore, which holds it (``_release``) so no eviction takes it meanwhile."""
        kept = self.items / cid / ASSEMBLED
        if self._take(cid, kept, use):
            return kept, True
        with self._lock:
            lock = self._assembling.setdefault(cid, threading.Lock())
        with lock:  # concurrent restores of one template assemble it once
            if self._take(cid, kept, use):
                return kept, True
            state = self.catalog.state_dir(cid)
            tmp = self.items / cid / f"{ASSEMBLED}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                tmp.mkdir()
                for p in state.iterdir():
                    if p.name != STATE_MANIFEST:  # relative: the links hold wherever the store is mounted
                        (tmp / p.name).symlink_to(Path("..") / "state" / p.name)
                self.chunks.assemble(state, tmp)
                with self._lock:
                    try:
                        os.rename(tmp, kept)
                    except OSError as e:  # another process renamed its own first: use that one
                        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                            raise
                    if use:
                        self._in_use[cid] += 1
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return kept, False

    def _take(self, cid: str, kept: Path, use: bool) -> bool:
        """Whether ``kept`` is there; for a restore (``use``) it is held from then on, and marked
        as the most recently used."""
        with self._lock:
            if not kept.is_dir():
                return False
            if use:
                self._in_use[cid] += 1
        if use:
            with contextlib.suppress(OSError):
                os.utime(kept)
        return True

    def _release(self, cid: str) -> None:
        with self._lock:
            self._in_use[cid] -= 1
            if self._in_use[cid] <= 0:
                del self._in_use[cid]

    def _kept_or_coming(self, cid: str) -> bool:
        """Whether a restore of ``cid`` should read its kept image: there, or being assembled ahead."""
        if self.shared:  # only templates' images are kept where nodes share the store
            return False
        # No lock: a set lookup is atomic, and this runs on the event loop.
        return cid in self._ahead or (self.items / cid / ASSEMBLED).is_dir()

    def assemble_ahead(self, cid: str, protect=()) -> Optional[asyncio.Future]:
        """Assemble committed checkpoint ``cid``'s image soon, in a worker thread, and keep it: its
        next restore (a fork) reads it instead of assembling it on its critical path. Then drop the
        least recently used kept images beyond ``kept_bytes``, never one in ``protect`` (templates)
        or one a restore is reading. One at a time, in the order asked: a burst of checkpoints
        neither takes every worker thread nor all checks the free disk before any has written.
        Returns a future done once this one is; None when nothing is kept (no budget, shared, a
        whole image)."""
        if not self.kept_bytes or not (self.catalog.state_dir(cid) / STATE_MANIFEST).is_file():
            return None
        with self._lock:
            self._ahead.add(cid)
        done = asyncio.get_running_loop().create_future()
        self._queue.append((cid, set(protect), done))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run_ahead())  # referenced: the loop keeps only a weak one
        return done

    async def _run_ahead(self) -> None:
        while self._queue:
            cid, protect, done = self._queue.popleft()
            try:
                await asyncio.to_thread(self._assemble_ahead, cid, protect)
            finally:
                if not done.done():
                    done.set_result(None)

    def _assemble_ahead(self, cid: str, protect: Set[str]) -> None:
        t0 = time.monotonic()
        try:
            if self.free() < self.keep_free + assembled_size(self.catalog.state_dir(cid)):
                log.info("checkpoint %s: image not kept assembled: under %d MB of disk would be left",
                         cid, self.keep_free >> 20)
            else:
                kept, had = self._assembled(cid)
                if not had:
                    log.info("checkpoint %s: image assembled ahead and kept in %.0f ms", cid,
                             (time.monotonic() - t0) * 1000)
        except (OSError, ValueError) as e:  # a full disk, or deleted meanwhile: a restore assembles it
            log.warning("checkpoint %s: image not assembled ahead: %s", cid, e)
        finally:
            with self._lock:
                self._ahead.discard(cid)
        self.evict_kept(protect, spare=cid)  # also when none was made: the disk may be short

    def evict_kept(self, protect=(), spare: str = "") -> int:
        """Drop kept images beyond ``kept_bytes``, or while the disk has under ``keep_free``
        free, least recently used first; ``protect``'s (templates') are neither counted nor
        dropped, ``spare``'s (the one just made) and those a restore reads are counted but not
        dropped. Returns how many were dropped."""
        protect = set(protect)
        free = self.free()
        kept = []
        for d in self.items.glob(f"*/{ASSEMBLED}"):
            try:
                kept.append((d.stat().st_mtime, dir_size(d), d))
            except OSError:
                continue
        total = sum(size for _, size, d in kept if d.parent.name not in protect)
        dropped = 0
        for _, size, d in sorted(kept):
            if total <= self.kept_bytes and free >= self.keep_free:
                break
            cid = d.parent.name
            if cid in protect or cid == spare:
                continue
            with self._lock:
                if self._in_use.get(cid) or cid in self._ahead:
                    continue
                gone = d.with_name(f"{ASSEMBLED}.tmp-{uuid.uuid4().hex[:8]}")
                try:  # renamed under the lock: no restore takes it from here on
                    os.rename(d, gone)
                except OSError:
                    continue
            shutil.rmtree(gone, ignore_errors=True)
            total -= size
            free += size
            dropped += 1
            log.info("checkpoint %s: kept image dropped (%d MB of kept images, at most %d)", cid, total >> 20,
                     self.kept_bytes >> 20)
        return dropped

    def free(self) -> int:
        st = os.statvfs(self.items)
        return st.f_bavail * st.f_frsize

    def forget(self, cid: str) -> None:
        """Checkpoint ``cid`` is gone."""
        with self._lock:
            self._assembling.pop(cid, None)

    def sweep(self, grace: float) -> None:
        """Remove what a crash left of assemblies: ``_assembled``, ``evict_kept`` and ``restorable``
        remove their own, perhaps just now, so only those older than ``grace`` seconds."""
        restoring = self.root / "restoring"
        for d in [*self.items.glob(f"*/{ASSEMBLED}.tmp-*"), *(restoring.iterdir() if restoring.is_dir() else ())]:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - d.stat().st_mtime > grace:
                    shutil.rmtree(d, ignore_errors=True)

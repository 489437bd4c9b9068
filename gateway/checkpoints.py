"""Checkpoints: the running-state image of a sandbox plus a snapshot of its
workspace, and the tree they form.

Workspace files are stored once each, by content (sha256), in a blob store
shared by all checkpoints of one owner: two checkpoints that differ by one
file add that one file. Deduplication stays inside an owner (a tenant): a
blob's name is the sha256 of its content for owner "" (the admin, and every
checkpoint taken before tenants), and ``blob_key(owner, sha)`` (a hash of the
owner and the content hash) for a tenant, so ``new_bytes`` of one tenant's
checkpoint never depends on what another tenant stored. A checkpoint is listed only once its record is written, and the
record is written last (atomically, by rename), so a checkpoint interrupted
by a crash, a full disk or a failing driver is never listed; its leftovers
are removed by ``sweep``.

What a snapshot keeps and what it never does:

- Regular files only. Symlinks are skipped and never followed (they could
  point anywhere on the host); device files, fifos and sockets are skipped.
  Directories are recreated as needed to hold the files, mode 0700; empty
  directories are not kept.
- Holes: sparse files are read and written by their data extents
  (SEEK_DATA/SEEK_HOLE), so a 4 GiB ``truncate`` costs no 4 GiB on the host,
  neither in the blob store nor in a materialised workspace. A blob is named
  by the sha256 of the file's logical content (holes read as zeros), so a
  sparse and a dense copy of the same bytes share one blob.
- Modes: ``mode & 0o777`` only; setuid, setgid and sticky bits are never
  stored or materialised.
- Hard links: names of one inode are read and counted once (the bounds,
  ``files_bytes``); the later names' entries carry ``link`` (the manifest key
  of the first) and are materialised as hard links to it, so a file with ten
  names does not come back as ten copies.
- Names are bytes: a name that is not valid UTF-8 is kept in the manifest as
  ``"b64:" + urlsafe-base64`` with ``FileEntry.b64`` set, and comes back
  byte-exact.
- Bounds (``SnapshotLimits``): file count and logical bytes are checked
  before anything is read, new stored bytes before anything is written;
  past one, ``SnapshotTooLarge`` names the bound and what was measured.

Every method may run in a worker thread (``snapshot_async``,
``materialize_async``, ``gc_async``), concurrently for different
workspaces: blobs are written under a temporary name and renamed, and the
blobs an unfinished snapshot uses are pinned so that a concurrent ``sweep``
or ``gc`` does not remove them.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import errno
import hashlib
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

from pydantic import BaseModel, Field, model_serializer, model_validator

from .state_chunks import MANIFEST as STATE_MANIFEST, ChunkStore, assembled_size, manifest_keys

CHUNK = 1 << 20
ASSEMBLED = "assembled"  # a checkpoint's images assembled from their chunks, kept (CheckpointStore.restorable)
_ZEROS = bytes(CHUNK)  # shared: holes are hashed from it, never read from disk
_COPY_STEP = 64 << 20  # copy_file_range per call, so a cancel is seen between steps
_SEEK_DATA = getattr(os, "SEEK_DATA", None)
_SEEK_HOLE = getattr(os, "SEEK_HOLE", None)

log = logging.getLogger("sandgate.checkpoints")


class FileEntry(BaseModel):
    sha256: str
    size: int  # logical size; holes included
    mode: int  # permission bits only (& 0o777)
    b64: bool = False  # the manifest key is "b64:" + urlsafe base64 of the name's bytes
    # A hard link: the manifest key of this inode's first name, materialised as a link to it. The
    # entry keeps sha256, size and mode too, so a gateway that predates ``link`` restores a copy.
    link: Optional[str] = None

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler):  # records stay as they were for UTF-8 names without links
        data = handler(self)
        if not self.b64:
            data.pop("b64", None)
        if self.link is None:
            data.pop("link", None)
        return data


def blob_key(owner: str, sha: str) -> str:
    """The blob store's name for content ``sha`` stored by ``owner``: the
    content hash itself for owner "", else a hash of both (its own namespace)."""
    if not owner:
        return sha
    return hashlib.sha256(b"sandgate-blob\0" + owner.encode() + b"\0" + sha.encode()).hexdigest()


class Checkpoint(BaseModel):
    id: str
    sandbox: str  # the sandbox (kernel) it was taken from
    owner: str = ""  # the tenant whose sandbox it was taken from ("" = the admin); its blobs are that owner's
    driver: str = ""  # the driver of that sandbox ("" in records from before it was kept)
    parent: Optional[str] = None  # the checkpoint that sandbox was restored from, if any
    created: float
    name: str = ""
    state_bytes: int  # the driver's running-state image
    files_bytes: int  # the workspace's logical size
    new_bytes: int  # what this checkpoint added to the blob store (data stored; holes are free)
    # What this checkpoint added to storage, state and files together: its new state chunks and
    # their manifest (state_chunks.py), the rest of its state directory, and new_bytes.
    stored_bytes: int = 0
    files: Dict[str, FileEntry] = {}
    # The sandbox's finished execution ids and kept results (core/executions.py): a retry after a
    # take-over from this checkpoint is answered from here, not run again.
    executions: dict = {}

    @model_validator(mode="before")
    @classmethod
    def _whole_image_before(cls, data):  # records from before chunking stored the whole image
        if isinstance(data, dict) and "stored_bytes" not in data and "state_bytes" in data:
            data = {**data, "stored_bytes": data["state_bytes"] + data.get("new_bytes", 0)}
        return data

    def summary(self) -> dict:
        return self.model_dump(exclude={"files", "executions"}) | {"file_count": len(self.files)}

    def paths(self) -> Dict[bytes, FileEntry]:
        """The manifest by file name as bytes, relative to the workspace."""
        return {decode_name(key, entry): entry for key, entry in self.files.items()}


class SnapshotLimits(BaseModel):
    """What one workspace snapshot may hold."""

    max_bytes: int = Field(16 << 30, ge=0)  # logical size of all files, holes included
    max_new_bytes: int = Field(4 << 30, ge=0)  # data written to the blob store by one snapshot
    max_files: int = Field(100_000, ge=0)  # regular files


class OverQuota(Exception):
    """An owner's checkpoints would store more than its quota (``StoreQuota``); nothing of
    the checkpoint is kept."""


class StoreQuota:
    """What an owner's checkpoints may store in all (``limit`` bytes) and hold now (``used``,
    ``CheckpointStore.usage``), and the refusal naming it."""

    def __init__(self, owner: str, limit: int, used: int, variable: str):
        self.owner, self.limit, self.used, self.variable = owner, limit, used, variable

    @property
    def left(self) -> int:
        return self.limit - self.used

    def refuse(self, adding: Optional[int] = None) -> OverQuota:
        """``adding``: what the checkpoint would store (None: refused before it began, the quota full)."""
        more = (f" and this checkpoint would add {adding} ({_human(adding)})" if adding is not None
                else ", no room for another")
        return OverQuota(
            f"tenant {self.owner}'s checkpoints store {self.used} bytes ({_human(self.used)}){more}; its quota "
            f"max_checkpoint_mb is {self.limit >> 20} MB ({self.variable}); delete checkpoints it no longer needs "
            f"(DELETE /api/sandboxes/{{id}}/checkpoints/{{checkpoint}}) or sandboxes")


class SnapshotTooLarge(Exception):
    """A workspace is beyond a bound of ``SnapshotLimits``; nothing of the
    snapshot is kept."""

    def __init__(self, bound: str, value: int, limit: int, variable: str, message: str):
        super().__init__(message)
        self.bound, self.value, self.limit, self.variable = bound, value, limit, variable


class _Cancelled(Exception):
    pass


class _Changed(RuntimeError):
    pass


def encode_name(raw: bytes) -> Tuple[str, bool]:
    """A manifest key for a file name (bytes relative to the workspace)."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return "b64:" + base64.urlsafe_b64encode(raw).decode("ascii"), True


def decode_name(key: str, entry: FileEntry) -> bytes:
    """The file name a manifest key stands for (old records: the key itself)."""
    if entry.b64:
        if not key.startswith("b64:"):
            raise ValueError(f"manifest key {key!r} is marked base64 but has no b64: prefix")
        return base64.urlsafe_b64decode(key[4:])
    return key.encode("utf-8", "surrogateescape")


def _safe_rel(raw: bytes) -> List[bytes]:
    parts = raw.split(b"/")
    if not raw or raw.startswith(b"/") or b"\0" in raw or any(p in (b"", b".", b"..") for p in parts):
        raise ValueError(f"unsafe path in a checkpoint manifest: {raw!r}")
    return parts


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _check(cancel: Optional[threading.Event]) -> None:
    if cancel is not None and cancel.is_set():
        raise _Cancelled()


def _extents(fd: int, size: int, sparse: bool) -> Iterator[Tuple[int, int]]:
    """The data ranges [start, end) of an open file of ``size`` bytes; what
    lies between them is a hole. ``sparse`` False: one range, no lseek."""
    if size <= 0:
        return
    if not sparse or _SEEK_DATA is None:
        yield 0, size
        return
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, _SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole is left
                return
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP) and off == 0:  # no hole support here
                yield 0, size
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, _SEEK_HOLE), size)
        yield start, end
        off = end


def _is_sparse(st: os.stat_result) -> bool:
    return st.st_blocks * 512 < st.st_size


def _hash_zeros(h, n: int, cancel=None) -> None:
    while n > 0:
        if n & (64 * CHUNK - 1) == 0:  # every 64 MiB of hole
            _check(cancel)
        k = min(n, CHUNK)
        h.update(_ZEROS[:k] if k < CHUNK else _ZEROS)
        n -= k


def _hash_file(fd: int, st: os.stat_result, buf: bytearray, cancel) -> Tuple[str, int]:
    """sha256 of the logical content and the number of data bytes."""
    h = hashlib.sha256()
    view = memoryview(buf)
    pos = data = 0
    for start, end in _extents(fd, st.st_size, _is_sparse(st)):
        _hash_zeros(h, start - pos, cancel)
        off = start
        while off < end:
            _check(cancel)
            n = os.preadv(fd, [view[:min(CHUNK, end - off)]], off)
            if n == 0:
                raise _Changed("shrank")
            h.update(view[:n])
            off += n
        data += end - start
        pos = end
    _hash_zeros(h, st.st_size - pos, cancel)
    return h.hexdigest(), data


def _copy_range(src: int, dst: int, start: int, end: int, buf: bytearray, cancel) -> None:
    off = start
    use_cfr = hasattr(os, "copy_file_range")
    while off < end:
        _check(cancel)
        n = 0
        if use_cfr:
            try:
                n = os.copy_file_range(src, dst, min(_COPY_STEP, end - off), off, off)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                use_cfr = False
                continue
        else:
            view = memoryview(buf)[:min(CHUNK, end - off)]
            n = os.preadv(src, [view], off)
            if n:
                done = 0
                while done < n:
                    done += os.pwrite(dst, view[done:n], off + done)
        if n == 0:
            raise _Changed("shrank")
        off += n


def _copy_sparse(src: int, dst: int, size: int, sparse: bool, buf: bytearray, cancel) -> int:
    """Copy ``size`` bytes of ``src`` into the empty ``dst``, data extents
    only; holes stay holes. Returns the data bytes copied."""
    data = 0
    for start, end in _extents(src, size, sparse):
        _copy_range(src, dst, start, end, buf, cancel)
        data += end - start
    os.ftruncate(dst, size)  # the trailing hole, if any
    return data


SMALL = 64 << 10  # files up to this size are read once and kept in memory until stored...
SMALL_BUDGET = 64 << 20  # ...up to this much in all


class _Found:
    __slots__ = ("rel", "path", "lst", "st", "sha", "data", "content", "first")

    def __init__(self, rel: bytes, path: bytes, lst: os.stat_result):
        self.rel, self.path, self.lst = rel, path, lst
        self.st: Optional[os.stat_result] = None
        self.sha = ""
        self.data = 0
        self.content: Optional[bytes] = None  # a small file's bytes, read while hashing
        self.first: Optional["_Found"] = None  # a hard link: the name of its inode found first


def _read_small(fd: int, size: int) -> bytes:
    parts, got = [], 0
    while True:
        b = os.pread(fd, size + 1 - got, got)  # one byte more: a file that grew is noticed
        if not b:
            break
        parts.append(b)
        got += len(b)
        if got > size:
            break
    if got != size:
        raise _Changed("resized")
    return b"".join(parts)


_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


# In a directory other gateway processes write too (a fleet's shared volume), a checkpoint
# without its record, or a blob no record names, may be another node's unfinished one:
# only those older than this are swept.
SHARED_GRACE = 3600.0
KEEP_FREE = 1 << 30  # CheckpointStore.keep_free: kept images give way below this much free disk


class CheckpointStore:
    def __init__(self, root: Path, limits: Optional[SnapshotLimits] = None, shared: bool = False, replica=None,
                 kept_bytes: int = 0):
        self.root = root
        self.shared = shared  # other nodes read (and, but for a replica, write) these checkpoints too
        self.replica = replica  # an S3Replica (checkpoint_replica.py): each commit is copied there
        self.blobs = root / "blobs"
        self.items = root / "items"
        self.chunks = ChunkStore(root / "chunks")  # running-state images, chunked (state_chunks.py)
        self.limits = limits or SnapshotLimits()
        self._blobs_b = os.fsencode(self.blobs) + b"/"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.items.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._open: Set[str] = set()  # new_dir'd, not yet committed or discarded: sweep leaves them
        self._pins: Dict[str, Set[str]] = {}  # pin key (a cid or a token) -> blobs an unfinished snapshot uses
        self._loose: Set[str] = set()  # tokens of finished snapshots taken without a cid
        self._running = 0
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

    # -- records -----------------------------------------------------------

    def new_dir(self) -> tuple[str, Path]:
        return self.new_dir_for(uuid.uuid4().hex[:12])

    def new_dir_for(self, cid: str) -> tuple[str, Path]:
        """An unfinished checkpoint's directory (sweep leaves it while this process has it open)."""
        path = self.items / cid
        with self._lock:
            self._open.add(cid)
            path.mkdir()
        return cid, path

    def state_dir(self, cid: str) -> Path:
        return self.items / cid / "state"

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
        with self._lock:
            if cid not in self._open:
                raise RuntimeError(f"checkpoint {cid} was discarded while it was being stored")
            self._pins.setdefault(cid, set()).update(keys)

    @contextlib.asynccontextmanager
    async def restorable(self, cid: str, move: bool = False, keep: bool = False):
        """A directory holding checkpoint ``cid``'s state image as its driver
        wrote it: the state directory itself for a whole image; else a new one
        (removed afterwards) with the images assembled from their chunks and
        the other files linked (``move``: moved, for a restore that consumes
        them; the checkpoint is discarded after). ``keep``: for a checkpoint
        restored again and again (a template), the images are assembled once
        and kept beside its state (``assembled/``) for every later restore."""
        state = self.state_dir(cid)
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
            state = self.state_dir(cid)
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
        # No lock: a set lookup is atomic, and sweep() may hold the lock for long on this thread's loop.
        return cid in self._ahead or (self.items / cid / ASSEMBLED).is_dir()

    def assemble_ahead(self, cid: str, protect=()) -> Optional[asyncio.Future]:
        """Assemble committed checkpoint ``cid``'s image soon, in a worker thread, and keep it: its
        next restore (a fork) reads it instead of assembling it on its critical path. Then drop the
        least recently used kept images beyond ``kept_bytes``, never one in ``protect`` (templates)
        or one a restore is reading. One at a time, in the order asked: a burst of checkpoints
        neither takes every worker thread nor all checks the free disk before any has written.
        Returns a future done once this one is; None when nothing is kept (no budget, shared, a
        whole image)."""
        if not self.kept_bytes or not (self.state_dir(cid) / STATE_MANIFEST).is_file():
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
            if self._free() < self.keep_free + assembled_size(self.state_dir(cid)):
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
        free = self._free()
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

    def _free(self) -> int:
        st = os.statvfs(self.items)
        return st.f_bavail * st.f_frsize

    def _blob(self, sha: str) -> Path:
        return self.blobs / sha[:2] / sha

    def commit(self, cp: Checkpoint, replicate: bool = True) -> None:
        """Make ``cp`` whole (its record, written last); then copy it to the replica, if any. A
        failed copy is logged: the checkpoint stands here, but another node cannot restore it."""
        self._commit_here(cp)
        if self.replica is not None and replicate:
            try:
                self.replica.upload(self, cp)
            except Exception as e:
                log.warning("checkpoint %s not copied to the replica (other nodes cannot restore it): %s", cp.id, e)

    def fetch(self, cid: str) -> Optional[Checkpoint]:
        """``cid`` from the replica when this node does not have it (another node took it)."""
        if self.replica is None:
            return None
        try:
            self.get(cid)
            return None
        except KeyError:
            return self.replica.fetch(self, cid)

    def _commit_here(self, cp: Checkpoint) -> None:
        path = self.items / cp.id / "checkpoint.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(cp.model_dump_json())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._close(cp.id)  # the record keeps its blobs from here on

    def get(self, cid: str) -> Checkpoint:
        path = self.items / cid / "checkpoint.json"
        if "/" in cid or not path.is_file():
            raise KeyError(cid)
        return Checkpoint.model_validate_json(path.read_text())

    def list(self, sandbox: Optional[str] = None, owner: Optional[str] = None) -> List[Checkpoint]:
        """Committed checkpoints, oldest first; of one sandbox, of one owner."""
        out = []
        for d in self.items.iterdir():
            try:
                cp = self.get(d.name)
            except (KeyError, ValueError, OSError):
                continue
            if (sandbox is None or cp.sandbox == sandbox) and (owner is None or cp.owner == owner):
                out.append(cp)
        return sorted(out, key=lambda c: c.created)

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
            total += sum(_stored(st) for st in _tree(state) if stat.S_ISREG(st.st_mode))
        for path in [*(self._blob(k) for k in blobs), *(self.chunks.path(k) for k in chunks)]:
            with contextlib.suppress(FileNotFoundError):
                total += _stored(os.stat(path))
        return total

    def unlist(self, cid: str) -> Checkpoint:
        """The first step of deleting committed checkpoint ``cid`` (the caller checked that nothing
        needs it): its record goes, so from now on it is not listed, restored or forked. Then
        ``remove``."""
        cp = self.get(cid)
        (self.items / cid / "checkpoint.json").unlink()
        return cp

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
        shutil.rmtree(self.items / cid, ignore_errors=True)
        with self._lock:
            self._assembling.pop(cid, None)

    def _close(self, cid: str) -> None:
        with self._lock:
            self._open.discard(cid)
            self._pins.pop(cid, None)
            self._release_loose()

    def _release_loose(self) -> None:  # under the lock
        # Pins of snapshots taken without a cid are kept until no checkpoint
        # is open and no snapshot runs: by then theirs was committed or dropped.
        if not self._open and not self._running:
            for token in self._loose:
                self._pins.pop(token, None)
            self._loose.clear()

    # -- snapshot ----------------------------------------------------------

    def _scan(self, workspace: Path, limits: SnapshotLimits, cancel) -> List[_Found]:
        """Every regular file under ``workspace`` (sorted, no link followed);
        the file-count and logical-size bounds checked on the way."""
        found: List[_Found] = []
        inodes: Dict[Tuple[int, int], _Found] = {}
        count = total = 0
        root = os.fsencode(workspace)
        stack: List[bytes] = [b""]
        while stack:
            _check(cancel)
            rel_dir = stack.pop()
            try:
                with os.scandir(root + b"/" + rel_dir if rel_dir else root) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except FileNotFoundError:
                continue
            subdirs = []
            for e in entries:
                rel = rel_dir + b"/" + e.name if rel_dir else e.name
                try:
                    if e.is_dir(follow_symlinks=False):
                        subdirs.append(rel)
                        continue
                    if not e.is_file(follow_symlinks=False):
                        continue  # symlinks, devices, fifos, sockets
                    count += 1
                    if count > limits.max_files:
                        continue  # still counted, for the message; no longer stat'ed
                    lst = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                f = _Found(rel, e.path, lst)
                if lst.st_nlink > 1:  # a hard link: its inode's bytes are counted (and read) once
                    f.first = inodes.setdefault((lst.st_dev, lst.st_ino), f)
                    if f.first is f:
                        f.first = None
                    else:
                        found.append(f)
                        continue
                total += lst.st_size
                found.append(f)
            stack.extend(reversed(subdirs))
        if count > limits.max_files:
            raise SnapshotTooLarge(
                "files", count, limits.max_files, "SANDGATE_CHECKPOINT_MAX_FILES",
                f"the workspace holds {count} files; a checkpoint holds at most {limits.max_files} "
                f"(SANDGATE_CHECKPOINT_MAX_FILES)")
        if total > limits.max_bytes:
            raise SnapshotTooLarge(
                "bytes", total, limits.max_bytes, "SANDGATE_CHECKPOINT_MAX_BYTES",
                f"the workspace holds {total} bytes ({_human(total)}) in its files, holes included; a checkpoint "
                f"holds at most {limits.max_bytes} ({_human(limits.max_bytes)}) (SANDGATE_CHECKPOINT_MAX_BYTES)")
        return found

    def _open_same(self, f: _Found, want: os.stat_result) -> int:
        """Open ``f`` without following a link and make sure it is still the
        regular file ``want`` describes."""
        fd = os.open(f.path, _OPEN_READ)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino) or (
                    want is f.st and (st.st_size, st.st_mtime_ns) != (want.st_size, want.st_mtime_ns)):
                raise _Changed("replaced")
            if f.st is None:
                f.st = st
        except BaseException:
            os.close(fd)
            raise
        return fd

    def snapshot(self, workspace: Path, limits: Optional[SnapshotLimits] = None, *, cid: Optional[str] = None,
                 cancel: Optional[threading.Event] = None, owner: str = "",
                 quota: Optional[StoreQuota] = None) -> tuple[Dict[str, FileEntry], int]:
        """Store the workspace's files; returns the manifest and the new bytes
        (data written to the blob store, in ``owner``'s namespace: what other
        owners stored is neither reused nor visible). ``cid``, from ``new_dir``: the
        blobs stay pinned until that checkpoint is committed or discarded.
        Raises ``SnapshotTooLarge`` past ``limits`` (default: the store's), ``OverQuota`` when
        the new bytes are more than ``quota`` has left (both before any blob is written);
        then, and on any other failure, the blobs it wrote are removed."""
        limits = limits or self.limits
        token = cid or "snap-" + uuid.uuid4().hex
        created: List[str] = []
        with self._lock:
            self._running += 1
        try:
            found = self._scan(workspace, limits, cancel)
            buf = bytearray(CHUNK)
            budget = SMALL_BUDGET
            leaders: Dict[Tuple[int, int], _Found] = {}  # inode -> its name that was read
            for f in found:  # hash everything before anything is stored
                _check(cancel)
                ino = (f.lst.st_dev, f.lst.st_ino)
                if f.first is not None and ino in leaders:  # another name of an inode read already
                    try:
                        lst = os.lstat(f.path)
                    except FileNotFoundError:
                        continue
                    if (lst.st_dev, lst.st_ino) != ino:
                        raise _Changed(f"{os.fsdecode(f.rel)!r} changed while the workspace was being checkpointed")
                    f.first = lead = leaders[ino]
                    f.st, f.sha = lead.st, lead.sha
                    continue
                f.first = None  # its first name was gone: this one is read instead
                try:
                    fd = self._open_same(f, f.lst)
                except FileNotFoundError:
                    f.sha = ""
                    continue
                except _Changed:
                    raise _Changed(f"{os.fsdecode(f.rel)!r} changed while the workspace was being checkpointed") from None
                try:
                    if f.st.st_size <= min(SMALL, budget) and not _is_sparse(f.st):
                        f.content = _read_small(fd, f.st.st_size)
                        f.sha, f.data = hashlib.sha256(f.content).hexdigest(), f.st.st_size
                        budget -= f.st.st_size
                    else:
                        f.sha, f.data = _hash_file(fd, f.st, buf, cancel)
                except _Changed:
                    raise _Changed(f"{os.fsdecode(f.rel)!r} changed while the workspace was being checkpointed") from None
                finally:
                    os.close(fd)
                if f.st.st_nlink > 1:
                    leaders[ino] = f
            found = [f for f in found if f.sha]
            shas = {blob_key(owner, f.sha) for f in found}
            with self._lock:  # pinned before looking: a sweep from now on keeps them
                if cid is not None and cid not in self._open:
                    raise RuntimeError(f"checkpoint {cid} was discarded while its workspace was being stored")
                self._pins.setdefault(token, set()).update(shas)
            missing: Dict[str, _Found] = {}
            for f in found:
                if f.sha not in missing and not os.path.exists(self._blob_path(blob_key(owner, f.sha))):
                    missing[f.sha] = f
                if missing.get(f.sha) is not f:
                    f.content = None  # stored already, or by another file
            need = sum(f.data for f in missing.values())
            if need > limits.max_new_bytes:
                raise SnapshotTooLarge(
                    "new_bytes", need, limits.max_new_bytes, "SANDGATE_CHECKPOINT_MAX_NEW_BYTES",
                    f"the checkpoint would store {need} new bytes ({_human(need)}); one checkpoint stores at most "
                    f"{limits.max_new_bytes} ({_human(limits.max_new_bytes)}) (SANDGATE_CHECKPOINT_MAX_NEW_BYTES)")
            if quota is not None and need > quota.left:
                raise quota.refuse(need)
            new = 0
            made: Set[bytes] = set()
            for sha, f in missing.items():
                _check(cancel)
                new += self._store_blob(f, blob_key(owner, sha), buf, cancel, created, made)
                f.content = None
            files: Dict[str, FileEntry] = {}
            for f in found:
                key, b64 = encode_name(f.rel)
                files[key] = FileEntry(sha256=f.sha, size=f.st.st_size, mode=f.st.st_mode & 0o777, b64=b64,
                                       link=encode_name(f.first.rel)[0] if f.first is not None else None)
        except BaseException as e:
            with self._lock:
                self._running -= 1
                self._pins.pop(token, None)
                self._release_loose()
            self._collect(created)  # what this attempt wrote is garbage now
            if isinstance(e, _Cancelled):
                raise asyncio.CancelledError() from None
            raise
        with self._lock:
            self._running -= 1
            if cid is None:
                self._loose.add(token)
            self._release_loose()
        return files, new

    def _blob_path(self, sha: str) -> bytes:
        return self._blobs_b + sha[:2].encode() + b"/" + sha.encode()

    def _store_blob(self, f: _Found, key: str, buf: bytearray, cancel, created: List[str], made: Set[bytes]) -> int:
        """Write one blob (named ``key``) under a temporary name, then rename it into place."""
        blob = self._blob_path(key)
        parent = blob[:-len(key) - 1]
        if parent not in made:
            try:
                os.mkdir(parent, 0o700)
            except FileExistsError:
                pass
            made.add(parent)
        tmp = b"%s.tmp-%s" % (blob, uuid.uuid4().hex[:8].encode())
        src = dst = -1
        try:
            if f.content is None:
                try:
                    src = self._open_same(f, f.st)
                except FileNotFoundError:
                    raise _Changed("gone") from None
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            if f.content is not None:
                view, data = memoryview(f.content), len(f.content)
                while view:
                    view = view[os.write(dst, view):]
            else:
                data = _copy_sparse(src, dst, f.st.st_size, _is_sparse(f.st), buf, cancel)
            os.close(dst)
            dst = -1
            os.replace(tmp, blob)
            created.append(key)
            return data
        except BaseException as e:
            if dst >= 0:
                os.close(dst)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if isinstance(e, _Changed):
                raise _Changed(f"{os.fsdecode(f.rel)!r} changed while the workspace was being checkpointed") from None
            raise
        finally:
            if src >= 0:
                os.close(src)

    def _collect(self, candidates: List[str]) -> None:
        """Remove these blobs unless a record or an unfinished snapshot uses them."""
        if not candidates:
            return
        with self._lock:
            live = self._live()
            for sha in candidates:
                if sha not in live and self._old(self._blob(sha)):
                    self._blob(sha).unlink(missing_ok=True)

    def _live(self) -> Set[str]:  # under the lock
        live = {blob_key(cp.owner, e.sha256) for cp in self.list() for e in cp.files.values()}
        for pinned in self._pins.values():
            live |= pinned
        return live

    # -- materialize -------------------------------------------------------

    def materialize(self, cp: Checkpoint, dest: Path, uid: Optional[int] = None,
                    cancel: Optional[threading.Event] = None) -> None:
        """Write the checkpoint's workspace into an empty ``dest``: holes kept,
        modes ``& 0o777``, directories 0700; with ``uid``, every file and
        directory (``dest`` included) is given to ``uid``:``uid``."""
        root = os.fsencode(dest)
        if not dest.is_dir():
            dest.mkdir(mode=0o700, parents=True, exist_ok=True)
        if uid is not None:
            os.chown(root, uid, uid, follow_symlinks=False)
        made: Set[bytes] = set()
        buf = bytearray(CHUNK)
        links: List[Tuple[bytes, bytes, str]] = []  # (name, name of the file it links to, its key)
        try:
            for key, entry in cp.files.items():
                _check(cancel)
                rel = decode_name(key, entry)
                parts = _safe_rel(rel)
                path = root
                for part in parts[:-1]:
                    path = path + b"/" + part
                    if path in made:
                        continue
                    try:
                        os.mkdir(path, 0o700)
                    except FileExistsError:
                        if not stat.S_ISDIR(os.lstat(path).st_mode):
                            raise ValueError(f"checkpoint {cp.id}: {path!r} is in the way of a directory")
                    if uid is not None:
                        os.chown(path, uid, uid, follow_symlinks=False)
                    made.add(path)
                target = path + b"/" + parts[-1]
                first = cp.files.get(entry.link) if entry.link is not None else None
                if first is not None and first.link is None and first.sha256 == entry.sha256:
                    links.append((target, root + b"/" + b"/".join(_safe_rel(decode_name(entry.link, first))), key))
                    continue  # linked once every file is written
                try:
                    src = os.open(self._blob(blob_key(cp.owner, entry.sha256)), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise FileNotFoundError(
                        f"checkpoint {cp.id} is damaged: blob of {os.fsdecode(rel)} is missing") from None
                try:
                    st = os.fstat(src)
                    if st.st_size != entry.size:
                        raise ValueError(f"checkpoint {cp.id} is damaged: blob of {os.fsdecode(rel)} has "
                                         f"{st.st_size} bytes, not {entry.size}")
                    dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                    try:
                        _copy_sparse(src, dst, entry.size, _is_sparse(st), buf, cancel)
                        if uid is not None:
                            os.fchown(dst, uid, uid)
                        os.fchmod(dst, entry.mode & 0o777)
                    finally:
                        os.close(dst)
                finally:
                    os.close(src)
            for target, first, key in links:
                _check(cancel)
                try:
                    os.link(first, target, follow_symlinks=False)
                except OSError as e:
                    raise ValueError(f"checkpoint {cp.id}: {key!r} not linked to its first name: {e}") from None
        except _Cancelled:
            raise asyncio.CancelledError() from None
        except _Changed:
            raise ValueError(f"checkpoint {cp.id} is damaged: a blob is shorter than its extents") from None

    # -- collection --------------------------------------------------------

    def sweep(self) -> int:
        """Remove unfinished checkpoints (no record, none open in this
        process), blobs no record and no unfinished snapshot uses, and
        leftover temporary blobs."""
        removed = 0
        with self._lock:
            for d in self.items.iterdir():
                if d.name not in self._open and not (d / "checkpoint.json").is_file() and self._old(d):
                    shutil.rmtree(d, ignore_errors=True)
                    removed += 1
            live = self._live()
            for blob in self.blobs.glob("*/*"):
                sha = blob.name.split(".tmp-")[0]
                if sha not in live and self._old(blob):  # an aborted or crashed write, or garbage
                    blob.unlink(missing_ok=True)
                    removed += 1
            removed += self.chunks.sweep(self._live_chunks(), self._old)
            restoring = self.root / "restoring"
            # _assembled(), evict_kept() and restorable() remove their own, perhaps just now (outside
            # the lock): those left for an hour are a crash's.
            for d in [*self.items.glob(f"*/{ASSEMBLED}.tmp-*"), *(restoring.iterdir() if restoring.is_dir() else ())]:
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - d.stat().st_mtime > SHARED_GRACE:
                        shutil.rmtree(d, ignore_errors=True)
        return removed

    def _live_chunks(self) -> Set[str]:  # under the lock
        live: Set[str] = set()
        for d in self.items.iterdir():
            if (d / "checkpoint.json").is_file() or d.name in self._open:
                try:
                    live.update(manifest_keys(d / "state"))
                except ValueError as e:  # a damaged manifest keeps nothing; say so
                    log.warning("checkpoint %s: %s", d.name, e)
        for pinned in self._pins.values():
            live |= pinned
        return live

    def _old(self, path: Path) -> bool:
        """Whether no other process can still be writing ``path`` (always, unless shared)."""
        if not self.shared:
            return True
        try:
            return time.time() - path.stat().st_mtime > SHARED_GRACE
        except OSError:
            return False

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


def _tree(path: Path) -> Iterator[os.stat_result]:
    """lstat of ``path`` and everything under it; links are not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    yield st
    if not stat.S_ISDIR(st.st_mode):
        return
    stack = [os.fsencode(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield st
            if stat.S_ISDIR(st.st_mode):
                stack.append(e.path)


def _stored(st: os.stat_result) -> int:
    """A stored file's data bytes: its size, less the holes of a sparse one."""
    return min(st.st_size, st.st_blocks * 512)


def dir_size(path: Path) -> int:
    """Logical size of the regular files under ``path`` (holes included;
    symlinks not followed)."""
    return sum(st.st_size for st in _tree(path) if stat.S_ISREG(st.st_mode))


def disk_usage(path: Path) -> int:
    """Bytes allocated on disk to ``path`` and everything under it
    (st_blocks * 512, each inode once; symlinks not followed)."""
    seen: Set[Tuple[int, int]] = set()
    total = 0
    for st in _tree(path):
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def now() -> float:
    return time.time()

"""Workspace files stored once each, by content, in a blob store shared by all checkpoints of one
owner (a tenant): two checkpoints that differ by one file add that one file. A blob's name is the
sha256 of its content for owner "" (the admin, and every checkpoint taken before tenants), and
``blob_key(owner, sha)`` for a tenant, so ``new_bytes`` of one tenant's checkpoint never depends on
what another tenant stored.

What a snapshot keeps and what it never does:

- Regular files only. Symlinks are skipped and never followed (they could
  point anywhere on the host); device files, fifos and sockets are skipped.
  Directories are recreated as needed to hold the files, mode 0700; empty
  directories are not kept.
- Holes: sparse files are read and written by their data extents
  (sparse.py), so a 4 GiB ``truncate`` costs no 4 GiB on the host,
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

Snapshots of different workspaces may run at once, each in its thread: blobs are written under a
temporary name and renamed, and the blobs an unfinished snapshot uses are pinned (pins.py) so that
a concurrent sweep does not remove them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import threading
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from .catalog import Catalog
from .pins import Pins
from .records import (Checkpoint, FileEntry, SnapshotLimits, SnapshotTooLarge, StoreQuota, blob_key, decode_name,
                      encode_name, human, safe_rel)
from .sparse import CHUNK, Cancelled, Changed, check_cancel, copy_sparse, hash_file, is_sparse, read_small

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


_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class BlobStore:
    """Blobs under ``root/<key[:2]>/<key>``: ``snapshot`` stores a workspace's files there,
    ``materialize`` writes them back out."""

    def __init__(self, root: Path, catalog: Catalog, pins: Pins, limits: SnapshotLimits):
        self.root = root
        self.catalog, self.pins, self.limits = catalog, pins, limits
        self._root_b = os.fsencode(root) + b"/"
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def _path_b(self, key: str) -> bytes:
        return self._root_b + key[:2].encode() + b"/" + key.encode()

    def _scan(self, workspace: Path, limits: SnapshotLimits, cancel) -> List[_Found]:
        """Every regular file under ``workspace`` (sorted, no link followed);
        the file-count and logical-size bounds checked on the way."""
        found: List[_Found] = []
        inodes: Dict[Tuple[int, int], _Found] = {}
        count = total = 0
        root = os.fsencode(workspace)
        stack: List[bytes] = [b""]
        while stack:
            check_cancel(cancel)
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
                f"the workspace holds {total} bytes ({human(total)}) in its files, holes included; a checkpoint "
                f"holds at most {limits.max_bytes} ({human(limits.max_bytes)}) (SANDGATE_CHECKPOINT_MAX_BYTES)")
        return found

    def _open_same(self, f: _Found, want: os.stat_result) -> int:
        """Open ``f`` without following a link and make sure it is still the
        regular file ``want`` describes."""
        fd = os.open(f.path, _OPEN_READ)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino) or (
                    want is f.st and (st.st_size, st.st_mtime_ns) != (want.st_size, want.st_mtime_ns)):
                raise Changed("replaced")
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
        self.pins.started()
        try:
            found = self._scan(workspace, limits, cancel)
            buf = bytearray(CHUNK)
            budget = SMALL_BUDGET
            leaders: Dict[Tuple[int, int], _Found] = {}  # inode -> its name that was read
            for f in found:  # hash everything before anything is stored
                check_cancel(cancel)
                ino = (f.lst.st_dev, f.lst.st_ino)
                if f.first is not None and ino in leaders:  # another name of an inode read already
                    try:
                        lst = os.lstat(f.path)
                    except FileNotFoundError:
                        continue
                    if (lst.st_dev, lst.st_ino) != ino:
                        raise Changed(f"{os.fsdecode(f.rel)!r} changed while the workspace was being checkpointed")
                    f.first = lead = leaders[ino]
                    f.st, f.sha = lead.st, lead.sha
                    continue
                f.first = None  # its first name was gone: this one is read instead
                try:
                    fd = self._open_same(f, f.lst)
                except FileNotFoundError:
                    f.sha = ""
                    continue
                except Changed:
                    raise Changed(f"{os.fsdecode(f.rel)!r} changed while the workspace was being checkpointed") from None
                try:
                    if f.st.st_size <= min(SMALL, budget) and not is_sparse(f.st):
                        f.content = read_small(fd, f.st.st_size)
                        f.sha, f.data = hashlib.sha256(f.content).hexdigest(), f.st.st_size
                        budget -= f.st.st_size
                    else:
                        f.sha, f.data = hash_file(fd, f.st, buf, cancel)
                except Changed:
                    raise Changed(f"{os.fsdecode(f.rel)!r} changed while the workspace was being checkpointed") from None
                finally:
                    os.close(fd)
                if f.st.st_nlink > 1:
                    leaders[ino] = f
            found = [f for f in found if f.sha]
            shas = {blob_key(owner, f.sha) for f in found}
            if not self.pins.pin(token, shas, cid):  # pinned before looking: a sweep from now on keeps them
                raise RuntimeError(f"checkpoint {cid} was discarded while its workspace was being stored")
            missing: Dict[str, _Found] = {}
            for f in found:
                if f.sha not in missing and not os.path.exists(self._path_b(blob_key(owner, f.sha))):
                    missing[f.sha] = f
                if missing.get(f.sha) is not f:
                    f.content = None  # stored already, or by another file
            need = sum(f.data for f in missing.values())
            if need > limits.max_new_bytes:
                raise SnapshotTooLarge(
                    "new_bytes", need, limits.max_new_bytes, "SANDGATE_CHECKPOINT_MAX_NEW_BYTES",
                    f"the checkpoint would store {need} new bytes ({human(need)}); one checkpoint stores at most "
                    f"{limits.max_new_bytes} ({human(limits.max_new_bytes)}) (SANDGATE_CHECKPOINT_MAX_NEW_BYTES)")
            if quota is not None and need > quota.left:
                raise quota.refuse(need)
            new = 0
            made: Set[bytes] = set()
            for sha, f in missing.items():
                check_cancel(cancel)
                new += self._store_blob(f, blob_key(owner, sha), buf, cancel, created, made)
                f.content = None
            files: Dict[str, FileEntry] = {}
            for f in found:
                key, b64 = encode_name(f.rel)
                files[key] = FileEntry(sha256=f.sha, size=f.st.st_size, mode=f.st.st_mode & 0o777, b64=b64,
                                       link=encode_name(f.first.rel)[0] if f.first is not None else None)
        except BaseException as e:
            self.pins.failed(token)
            self.collect(created)  # what this attempt wrote is garbage now
            if isinstance(e, Cancelled):
                raise asyncio.CancelledError() from None
            raise
        self.pins.finished(token, loose=cid is None)
        return files, new

    def _store_blob(self, f: _Found, key: str, buf: bytearray, cancel, created: List[str], made: Set[bytes]) -> int:
        """Write one blob (named ``key``) under a temporary name, then rename it into place."""
        blob = self._path_b(key)
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
                    raise Changed("gone") from None
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            if f.content is not None:
                view, data = memoryview(f.content), len(f.content)
                while view:
                    view = view[os.write(dst, view):]
            else:
                data = copy_sparse(src, dst, f.st.st_size, is_sparse(f.st), buf, cancel)
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
            if isinstance(e, Changed):
                raise Changed(f"{os.fsdecode(f.rel)!r} changed while the workspace was being checkpointed") from None
            raise
        finally:
            if src >= 0:
                os.close(src)

    def collect(self, candidates: List[str]) -> None:
        """Remove these blobs unless a record or an unfinished snapshot uses them."""
        if not candidates:
            return
        with self.pins.lock:
            live = self.live()
            for key in candidates:
                if key not in live and self.pins.old(self.path(key)):
                    self.path(key).unlink(missing_ok=True)

    def live(self) -> Set[str]:
        """The blobs a record names or an unfinished snapshot pinned (hold ``pins.lock``)."""
        live = {blob_key(cp.owner, e.sha256) for cp in self.catalog.list() for e in cp.files.values()}
        return live | self.pins.pinned()

    def sweep(self) -> int:
        """Remove blobs nothing uses and leftover temporary ones (hold ``pins.lock``); returns how many."""
        removed = 0
        live = self.live()
        for blob in self.root.glob("*/*"):
            key = blob.name.split(".tmp-")[0]
            if key not in live and self.pins.old(blob):  # an aborted or crashed write, or garbage
                blob.unlink(missing_ok=True)
                removed += 1
        return removed

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
                check_cancel(cancel)
                rel = decode_name(key, entry)
                parts = safe_rel(rel)
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
                    links.append((target, root + b"/" + b"/".join(safe_rel(decode_name(entry.link, first))), key))
                    continue  # linked once every file is written
                try:
                    src = os.open(self.path(blob_key(cp.owner, entry.sha256)), os.O_RDONLY | os.O_CLOEXEC)
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
                        copy_sparse(src, dst, entry.size, is_sparse(st), buf, cancel)
                        if uid is not None:
                            os.fchown(dst, uid, uid)
                        os.fchmod(dst, entry.mode & 0o777)
                    finally:
                        os.close(dst)
                finally:
                    os.close(src)
            for target, first, key in links:
                check_cancel(cancel)
                try:
                    os.link(first, target, follow_symlinks=False)
                except OSError as e:
                    raise ValueError(f"checkpoint {cp.id}: {key!r} not linked to its first name: {e}") from None
        except Cancelled:
            raise asyncio.CancelledError() from None
        except Changed:
            raise ValueError(f"checkpoint {cp.id} is damaged: a blob is shorter than its extents") from None

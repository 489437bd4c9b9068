"""Checkpoints: the running-state image of a sandbox plus a snapshot of its
workspace, and the tree they form.

Workspace files are stored once each, by content (sha256), in a blob store
shared by all checkpoints: two checkpoints that differ by one file add that
one file. A checkpoint is listed only once its record is written, and the
record is written last (atomically, by rename), so a checkpoint interrupted
by a crash, a full disk or a failing driver is never listed; its leftovers
are removed by ``sweep``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from pydantic import BaseModel


class FileEntry(BaseModel):
    sha256: str
    size: int
    mode: int


class Checkpoint(BaseModel):
    id: str
    sandbox: str  # the sandbox (kernel) it was taken from
    parent: Optional[str] = None  # the checkpoint that sandbox was restored from, if any
    created: float
    name: str = ""
    state_bytes: int  # the driver's running-state image
    files_bytes: int  # the workspace's logical size
    new_bytes: int  # what this checkpoint added to the blob store
    files: Dict[str, FileEntry] = {}

    def summary(self) -> dict:
        return self.model_dump(exclude={"files"}) | {"file_count": len(self.files)}


class CheckpointStore:
    def __init__(self, root: Path):
        self.root = root
        self.blobs = root / "blobs"
        self.items = root / "items"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.items.mkdir(parents=True, exist_ok=True)

    def new_dir(self) -> tuple[str, Path]:
        cid = uuid.uuid4().hex[:12]
        path = self.items / cid
        path.mkdir()
        return cid, path

    def state_dir(self, cid: str) -> Path:
        return self.items / cid / "state"

    def _blob(self, sha: str) -> Path:
        return self.blobs / sha[:2] / sha

    def snapshot(self, workspace: Path) -> tuple[Dict[str, FileEntry], int]:
        """Store the workspace's files; returns the manifest and the new bytes."""
        files: Dict[str, FileEntry] = {}
        new = 0
        for dirpath, dirnames, filenames in os.walk(workspace):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if path.is_symlink() or not path.is_file():
                    continue  # links could point anywhere on the host: not followed
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                sha = h.hexdigest()
                st = path.stat()
                blob = self._blob(sha)
                if not blob.exists():
                    blob.parent.mkdir(exist_ok=True)
                    tmp = blob.with_name(f"{sha}.tmp-{uuid.uuid4().hex[:6]}")
                    shutil.copyfile(path, tmp)
                    os.replace(tmp, blob)
                    new += st.st_size
                files[str(path.relative_to(workspace))] = FileEntry(sha256=sha, size=st.st_size, mode=st.st_mode & 0o777)
        return files, new

    def materialize(self, cp: Checkpoint, dest: Path, uid: Optional[int] = None) -> None:
        """Write the checkpoint's workspace into an empty ``dest``."""
        dest.mkdir(parents=True, exist_ok=True)
        for rel, entry in cp.files.items():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            blob = self._blob(entry.sha256)
            if not blob.exists():
                raise FileNotFoundError(f"checkpoint {cp.id} is damaged: blob of {rel} is missing")
            shutil.copyfile(blob, target)
            os.chmod(target, entry.mode)
        if uid is not None:
            for dirpath, _, filenames in os.walk(dest):
                os.chown(dirpath, uid, uid)
                for name in filenames:
                    os.chown(os.path.join(dirpath, name), uid, uid)

    def commit(self, cp: Checkpoint) -> None:
        path = self.items / cp.id / "checkpoint.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(cp.model_dump_json())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def get(self, cid: str) -> Checkpoint:
        path = self.items / cid / "checkpoint.json"
        if "/" in cid or not path.is_file():
            raise KeyError(cid)
        return Checkpoint.model_validate_json(path.read_text())

    def list(self, sandbox: Optional[str] = None) -> List[Checkpoint]:
        out = []
        for d in self.items.iterdir():
            try:
                cp = self.get(d.name)
            except (KeyError, ValueError):
                continue
            if sandbox is None or cp.sandbox == sandbox:
                out.append(cp)
        return sorted(out, key=lambda c: c.created)

    def discard(self, cid: str) -> None:
        shutil.rmtree(self.items / cid, ignore_errors=True)

    def sweep(self) -> int:
        """Remove unfinished checkpoints (no record) and blobs no record uses."""
        removed = 0
        for d in self.items.iterdir():
            if not (d / "checkpoint.json").is_file():
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
        live = {e.sha256 for cp in self.list() for e in cp.files.values()}
        for blob in self.blobs.glob("*/*"):
            if blob.name not in live:
                blob.unlink(missing_ok=True)
                removed += 1
        return removed

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
        return len(dropped) + self.sweep()


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def now() -> float:
    return time.time()

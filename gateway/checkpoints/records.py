"""What a checkpoint is on record: its ``Checkpoint`` (the running state's size, the workspace's
manifest of ``FileEntry``), the names its files and blobs go by, and the bounds and quota a
snapshot is held to (``SnapshotLimits``, ``StoreQuota``) with the errors that name them."""

from __future__ import annotations

import base64
import hashlib
from typing import Dict, List, Optional, Tuple

from pydantic import BaseModel, Field, model_serializer, model_validator


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
        more = (f" and this checkpoint would add {adding} ({human(adding)})" if adding is not None
                else ", no room for another")
        return OverQuota(
            f"tenant {self.owner}'s checkpoints store {self.used} bytes ({human(self.used)}){more}; its quota "
            f"max_checkpoint_mb is {self.limit >> 20} MB ({self.variable}); delete checkpoints it no longer needs "
            f"(DELETE /api/sandboxes/{{id}}/checkpoints/{{checkpoint}}) or sandboxes")


class SnapshotTooLarge(Exception):
    """A workspace is beyond a bound of ``SnapshotLimits``; nothing of the
    snapshot is kept."""

    def __init__(self, bound: str, value: int, limit: int, variable: str, message: str):
        super().__init__(message)
        self.bound, self.value, self.limit, self.variable = bound, value, limit, variable


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


def safe_rel(raw: bytes) -> List[bytes]:
    parts = raw.split(b"/")
    if not raw or raw.startswith(b"/") or b"\0" in raw or any(p in (b"", b".", b"..") for p in parts):
        raise ValueError(f"unsafe path in a checkpoint manifest: {raw!r}")
    return parts


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)

"""Checkpoints copied to an S3-compatible object store, for a fleet without a shared volume.

``SANDGATE_CHECKPOINT_STORE=s3://bucket/prefix`` (boto3; the endpoint, region and credentials come
from boto3's usual settings: ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``, ...).
Each node keeps its checkpoints in its home as always (store.py); every committed one is
also uploaded, under the same layout: its running state ``items/<cid>/state/...``, the blobs its
files need ``blobs/<key>`` (content-addressed, so uploaded once), and its record
``items/<cid>/checkpoint.json`` last, so a record in the bucket means the checkpoint is whole
there. Another node that takes a sandbox over (core/fleet.py) fetches that checkpoint first.

A running state kept as chunks here (state_chunks.py) is uploaded as its whole image, assembled:
one object per chunk was thousands of requests per checkpoint (minutes against a local S3 server).
So the bucket holds whole images, as before chunking, and a node that fetches one keeps it whole.

All calls block (boto3); callers run them off the event loop.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path
from typing import Optional, Set
from urllib.parse import urlparse

from .records import Checkpoint, blob_key
from .state_chunks import MANIFEST
from .store import CheckpointStore

log = logging.getLogger("sandgate.checkpoints")


class S3Replica:
    def __init__(self, url: str, client=None):
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an s3://bucket/prefix URL: {url!r}")
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        if client is None:
            import boto3

            client = boto3.client("s3")
        self.s3 = client
        self._known: Set[str] = set()  # blob keys this process has seen in the bucket

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _has(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=key)
            return True
        except self.s3.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def upload(self, store: CheckpointStore, cp: Checkpoint) -> int:
        """Copy a committed checkpoint to the bucket; returns the bytes sent."""
        sent = 0
        state = store.state_dir(cp.id)
        whole = None
        if (state / MANIFEST).is_file():  # the image itself goes up, not its chunks
            whole = store.root / "restoring" / f"upload-{uuid.uuid4().hex[:12]}"
            whole.mkdir(parents=True)
            store.chunks.assemble(state, whole, level=1)  # deflated: a quarter of the stored frames' bytes
        try:
            files = [(p, p.relative_to(state)) for p in state.rglob("*") if p.is_file() and p.name != MANIFEST]
            files += [(p, p.relative_to(whole)) for p in whole.iterdir()] if whole else []
            for path, rel in sorted(files):
                self.s3.upload_file(str(path), self.bucket, self._key("items", cp.id, "state", str(rel)))
                sent += path.stat().st_size
        finally:
            if whole:
                shutil.rmtree(whole, ignore_errors=True)
        for entry in cp.files.values():
            key = blob_key(cp.owner, entry.sha256)
            if key in self._known:
                continue
            if not self._has(self._key("blobs", key)):
                blob = store.blobs.path(key)
                self.s3.upload_file(str(blob), self.bucket, self._key("blobs", key))
                sent += blob.stat().st_size
            self._known.add(key)
        record = store.items / cp.id / "checkpoint.json"
        self.s3.upload_file(str(record), self.bucket, self._key("items", cp.id, "checkpoint.json"))
        log.info("checkpoint %s copied to s3://%s/%s (%d B)", cp.id, self.bucket, self._key(), sent)
        return sent

    def fetch(self, store: CheckpointStore, cid: str) -> Optional[Checkpoint]:
        """Bring a checkpoint another node uploaded into this node's store; None if the bucket has none."""
        if "/" in cid or not self._has(self._key("items", cid, "checkpoint.json")):
            return None
        _, item = store.new_dir_for(cid)
        try:
            pages = self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key("items", cid, "state") + "/")
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(self._key("items", cid, "state")) + 1:]
                    dest = item / "state" / rel
                    if ".." in Path(rel).parts:
                        raise ValueError(f"unsafe key in the bucket: {obj['Key']}")
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    self.s3.download_file(self.bucket, obj["Key"], str(dest))
            tmp = item / "checkpoint.json.download"
            self.s3.download_file(self.bucket, self._key("items", cid, "checkpoint.json"), str(tmp))
            cp = Checkpoint.model_validate_json(tmp.read_text())
            for entry in cp.files.values():
                key = blob_key(cp.owner, entry.sha256)
                blob = store.blobs.path(key)
                if not blob.exists():
                    blob.parent.mkdir(parents=True, exist_ok=True)
                    part = blob.with_name(blob.name + ".download")
                    self.s3.download_file(self.bucket, self._key("blobs", key), str(part))
                    part.rename(blob)
            store.commit(cp, replicate=False)  # whole here too, from now on
            tmp.unlink(missing_ok=True)
        except BaseException:
            store.discard(cid)
            raise
        log.info("checkpoint %s fetched from s3://%s/%s", cid, self.bucket, self._key())
        return cp

    def delete(self, cid: str) -> None:
        """The record first (the checkpoint is gone from then on), then its state. Blobs stay: other
        checkpoints, of any node, may share them."""
        self.s3.delete_object(Bucket=self.bucket, Key=self._key("items", cid, "checkpoint.json"))
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                   Prefix=self._key("items", cid) + "/")
        for page in pages:
            for obj in page.get("Contents", []):
                self.s3.delete_object(Bucket=self.bucket, Key=obj["Key"])

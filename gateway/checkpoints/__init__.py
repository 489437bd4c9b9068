"""Checkpoints: the running-state image of a sandbox plus a snapshot of its workspace, and the
tree they form.

A checkpoint is listed only once its record is written, and the record is written last
(atomically, by rename), so a checkpoint interrupted by a crash, a full disk or a failing driver is
never listed; its leftovers are removed by ``CheckpointStore.sweep``.

One module per concern, ``CheckpointStore`` (store.py) composing them:

- records.py: ``Checkpoint``, ``FileEntry``, the bounds (``SnapshotLimits``) and quota
  (``StoreQuota``) and the errors that name them;
- catalog.py: ``Catalog``, the records on disk;
- blobs.py: ``BlobStore``, workspace files by content, snapshot and materialise;
- sparse.py: files read, hashed and copied by their data extents, holes kept;
- state_chunks.py: running-state images as shared compressed chunks (``ChunkStore``);
- images.py: ``ImageCache``, images assembled for a restore, and those kept assembled;
- pins.py: ``Pins``, what a sweep must leave;
- replica.py: ``S3Replica``, checkpoints copied to a bucket for a fleet (imported where used: boto3).
"""

from .records import (Checkpoint, FileEntry, OverQuota, SnapshotLimits, SnapshotTooLarge, StoreQuota, blob_key,
                      decode_name, encode_name)
from .sparse import dir_size, disk_usage
from .store import CheckpointStore

__all__ = ["Checkpoint", "CheckpointStore", "FileEntry", "OverQuota", "SnapshotLimits", "SnapshotTooLarge",
           "StoreQuota", "blob_key", "decode_name", "dir_size", "disk_usage", "encode_name"]

"""What a sweep of the checkpoint store must leave alone: the checkpoints this process has open
(made by ``new_dir``, not yet committed or discarded), the blobs and chunks unfinished work uses
(pinned until its record names them), and, in a directory other gateway processes write too, whatever
is recent enough that another node may still be writing it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Dict, Optional, Set

# In a directory other gateway processes write too (a fleet's shared volume), a checkpoint
# without its record, or a blob no record names, may be another node's unfinished one:
# only those older than this are swept.
SHARED_GRACE = 3600.0


class Pins:
    """``lock`` is held by a sweep from reading what is live to removing what is not, and by
    anything that pins before it looks (a snapshot checks which blobs exist only once its own
    are pinned); reentrant, so a caller holding it may use every method here."""

    def __init__(self, shared: bool = False):
        self.shared = shared
        self.lock = threading.RLock()
        self._open: Set[str] = set()  # new_dir'd, not yet committed or discarded: sweep leaves them
        self._keys: Dict[str, Set[str]] = {}  # pin key (a cid or a token) -> blobs or chunks it uses
        self._loose: Set[str] = set()  # tokens of finished snapshots taken without a cid
        self._running = 0  # snapshots in progress

    def open(self, cid: str) -> None:
        with self.lock:
            self._open.add(cid)

    def is_open(self, cid: str) -> bool:
        with self.lock:
            return cid in self._open

    def pin(self, token: str, keys, cid: Optional[str] = None) -> bool:
        """Keep ``keys`` from a sweep under ``token``; with ``cid``, only while that checkpoint is
        open (False, nothing pinned, once it was discarded)."""
        with self.lock:
            if cid is not None and cid not in self._open:
                return False
            self._keys.setdefault(token, set()).update(keys)
            return True

    def close(self, cid: str) -> None:
        """Checkpoint ``cid`` was committed (its record keeps what it uses from here on) or discarded."""
        with self.lock:
            self._open.discard(cid)
            self._keys.pop(cid, None)
            self._release_loose()

    def started(self) -> None:
        """A snapshot began."""
        with self.lock:
            self._running += 1

    def finished(self, token: str, loose: bool) -> None:
        """A snapshot ended well; ``loose``: it was taken without a cid, its pins stay a while."""
        with self.lock:
            self._running -= 1
            if loose:
                self._loose.add(token)
            self._release_loose()

    def failed(self, token: str) -> None:
        """A snapshot ended badly: what it pinned is garbage now."""
        with self.lock:
            self._running -= 1
            self._keys.pop(token, None)
            self._release_loose()

    def _release_loose(self) -> None:
        # Pins of snapshots taken without a cid are kept until no checkpoint
        # is open and no snapshot runs: by then theirs was committed or dropped.
        if not self._open and not self._running:
            for token in self._loose:
                self._keys.pop(token, None)
            self._loose.clear()

    def pinned(self) -> Set[str]:
        """Every key pinned now (hold ``lock`` to act on it)."""
        with self.lock:
            return set().union(*self._keys.values())

    def old(self, path: Path) -> bool:
        """Whether no other process can still be writing ``path`` (always, unless shared)."""
        if not self.shared:
            return True
        try:
            return time.time() - path.stat().st_mtime > SHARED_GRACE
        except OSError:
            return False

"""The checkpoints on record: one directory per checkpoint under ``items/``, its record
(``checkpoint.json``) written last, atomically, so a checkpoint is listed only once it is whole."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import List, Optional

from .records import Checkpoint

RECORD = "checkpoint.json"


class Catalog:
    def __init__(self, items: Path):
        self.items = items
        items.mkdir(parents=True, exist_ok=True)

    def make_dir(self, cid: str) -> Path:
        path = self.items / cid
        path.mkdir()
        return path

    def state_dir(self, cid: str) -> Path:
        return self.items / cid / "state"

    def has_record(self, d: Path) -> bool:
        return (d / RECORD).is_file()

    def write(self, cp: Checkpoint) -> None:
        """``cp``'s record, in place of the one it had, if any: written aside, synced, renamed."""
        path = self.items / cp.id / RECORD
        tmp = path.with_suffix(".tmp")
        tmp.write_text(cp.model_dump_json())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def get(self, cid: str) -> Checkpoint:
        path = self.items / cid / RECORD
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

    def unlist(self, cid: str) -> Checkpoint:
        """Remove ``cid``'s record (it is no longer listed); returns what it said."""
        cp = self.get(cid)
        (self.items / cid / RECORD).unlink()
        return cp

    def remove_dir(self, cid: str) -> None:
        shutil.rmtree(self.items / cid, ignore_errors=True)

    def unfinished(self, is_open, old) -> List[Path]:
        """Directories without a record that ``is_open`` does not claim and ``old`` says no other
        process is still writing."""
        return [d for d in self.items.iterdir()
                if not is_open(d.name) and not self.has_record(d) and old(d)]

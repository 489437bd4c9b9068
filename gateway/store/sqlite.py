"""The embedded session store: one SQLite file under the gateway's home.

No service to run. WAL mode with ``synchronous=NORMAL``: a commit is a write
to the log without an fsync (a power cut can lose the last few transitions,
never corrupt the file), a few hundred microseconds, so the calls run on the
event loop. A transition's compare-and-set is one ``UPDATE ... WHERE state =``.

Its files (the database, ``-wal``, ``-shm``) are 0600: the database is made so before SQLite opens
it, and SQLite gives its WAL and shared-memory files the database's mode. Secret values are sealed
(store/seal.py) with the home's ``secrets.key``, or the fleet key; ``secure_delete`` zeroes what a
write replaces, so a value rewritten sealed leaves no clear copy in the file's free space.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path
from typing import List, Optional

from ..core.record import NotebookSessionRecord, SandboxRecord, TenantRecord
from ..core.states import State
from . import seal
from .base import SessionStore

log = logging.getLogger("sandgate.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS notebook_sessions (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    path TEXT NOT NULL,
    record TEXT NOT NULL,
    UNIQUE (owner, path)  -- one session per path and owner, enforced by SQLite itself
);
"""


class SQLiteStore(SessionStore):
    def __init__(self, path: Path, node: str = "local", sealer: Optional[seal.Sealer] = None):
        self.node = node
        path.parent.mkdir(parents=True, exist_ok=True)
        # 0600 before SQLite opens it: its -wal and -shm files are created with the database's mode
        # (under a umask of 022 they would be 0644 copies of every record, secret values included).
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        path.chmod(0o600)
        self.db = sqlite3.connect(str(path), isolation_level=None)  # autocommit; one statement each
        self.db.execute("PRAGMA secure_delete=ON")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        for extra in ("-wal", "-shm"):  # a home from before: its files kept their old modes
            side = path.with_name(path.name + extra)
            if side.exists():
                side.chmod(0o600)
        self.sealer = sealer or seal.Sealer.from_home(path.parent)
        self._check_key()

    def _check_key(self) -> None:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'seal_check'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta (key, value) VALUES ('seal_check', ?)", (self.sealer.check,))
        elif row[0] != self.sealer.check:
            raise seal.SealError(f"the session store's secret values were sealed with another key than the one from "
                                 f"{self.sealer.source} (SANDGATE_FLEET_KEY changed, or the home's secrets.key was "
                                 "replaced): start with the key they were sealed with")

    def _load(self, raw: str) -> SandboxRecord:
        return seal.load(raw, self.sealer)[0]

    async def reseal(self) -> int:
        """Rewrite records whose secret values are in clear (from before sealing), sealed; then the
        WAL is checkpointed and truncated so no clear copy stays there. The number rewritten."""
        n = 0
        for sid, raw in self.db.execute("SELECT id, record FROM sandboxes").fetchall():
            rec, clear = seal.load(raw, self.sealer)
            if clear:  # only if unchanged meanwhile (nothing else writes now, but say so)
                n += self.db.execute("UPDATE sandboxes SET record = ? WHERE id = ? AND record = ?",
                                     (seal.dump(rec, self.sealer), sid, raw)).rowcount
        if n:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            log.info("sealed the secret values of %d sandbox records stored in clear", n)
        return n

    async def get(self, sandbox_id: str) -> Optional[SandboxRecord]:
        row = self.db.execute("SELECT record FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return self._load(row[0]) if row else None

    async def put(self, record: SandboxRecord) -> SandboxRecord:
        row = self.db.execute("SELECT version FROM sandboxes WHERE id = ?", (record.id,)).fetchone()
        record = record.model_copy(update={"version": (row[0] if row else 0) + 1})
        self.db.execute("INSERT OR REPLACE INTO sandboxes (id, node, state, version, record) VALUES (?, ?, ?, ?, ?)",
                        (record.id, record.node, record.state.value, record.version, seal.dump(record, self.sealer)))
        return record

    async def compare_and_set(self, record: SandboxRecord, expected: State) -> bool:
        new = record.model_copy(update={"version": record.version + 1})
        cur = self.db.execute("UPDATE sandboxes SET node = ?, state = ?, version = version + 1, record = ? "
                              "WHERE id = ? AND state = ?",
                              (new.node, new.state.value, seal.dump(new, self.sealer), new.id, expected.value))
        return cur.rowcount == 1

    async def delete(self, sandbox_id: str) -> None:
        self.db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    async def list(self, node: Optional[str] = None) -> List[SandboxRecord]:
        q, args = "SELECT record FROM sandboxes", ()
        if node is not None:
            q, args = q + " WHERE node = ?", (node,)
        return [self._load(r[0]) for r in self.db.execute(q + " ORDER BY rowid", args)]

    async def create_tenant(self, record: TenantRecord) -> bool:
        cur = self.db.execute("INSERT OR IGNORE INTO tenants (name, record) VALUES (?, ?)",
                              (record.name, record.model_dump_json()))
        return cur.rowcount == 1

    async def get_tenant(self, name: str) -> Optional[TenantRecord]:
        row = self.db.execute("SELECT record FROM tenants WHERE name = ?", (name,)).fetchone()
        return TenantRecord.model_validate_json(row[0]) if row else None

    async def list_tenants(self) -> List[TenantRecord]:
        return [TenantRecord.model_validate_json(r[0]) for r in self.db.execute("SELECT record FROM tenants ORDER BY name")]

    async def replace_tenant(self, record: TenantRecord, token_hash: str) -> bool:
        cur = self.db.execute("UPDATE tenants SET record = ? WHERE name = ? AND json_extract(record, '$.token_hash') = ?",
                              (record.model_dump_json(), record.name, token_hash))
        return cur.rowcount == 1

    async def delete_tenant(self, name: str) -> bool:
        return self.db.execute("DELETE FROM tenants WHERE name = ?", (name,)).rowcount == 1

    async def put_session(self, record: NotebookSessionRecord) -> bool:
        try:
            # An upsert on the id, not INSERT OR REPLACE: that would delete the
            # other session holding the path instead of failing.
            self.db.execute("INSERT INTO notebook_sessions (id, owner, path, record) VALUES (?, ?, ?, ?) "
                            "ON CONFLICT (id) DO UPDATE SET path = excluded.path, record = excluded.record",
                            (record.id, record.owner, record.path, record.model_dump_json()))
        except sqlite3.IntegrityError:
            return False
        return True

    async def get_session(self, session_id: str) -> Optional[NotebookSessionRecord]:
        row = self.db.execute("SELECT record FROM notebook_sessions WHERE id = ?", (session_id,)).fetchone()
        return NotebookSessionRecord.model_validate_json(row[0]) if row else None

    async def session_by_path(self, owner: str, path: str) -> Optional[NotebookSessionRecord]:
        row = self.db.execute("SELECT record FROM notebook_sessions WHERE owner = ? AND path = ?",
                              (owner, path)).fetchone()
        return NotebookSessionRecord.model_validate_json(row[0]) if row else None

    async def list_sessions(self, owner: Optional[str] = None) -> List[NotebookSessionRecord]:
        q, args = "SELECT record FROM notebook_sessions", ()
        if owner is not None:
            q, args = q + " WHERE owner = ?", (owner,)
        return [NotebookSessionRecord.model_validate_json(r[0]) for r in self.db.execute(q + " ORDER BY rowid", args)]

    async def delete_session(self, session_id: str) -> bool:
        return self.db.execute("DELETE FROM notebook_sessions WHERE id = ?", (session_id,)).rowcount == 1

    async def close(self) -> None:
        self.db.close()

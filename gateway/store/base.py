"""The session store interface: where sandbox records live outside one process.

The embedded default (store/sqlite.py) keeps them in one SQLite file under
the gateway's home, so a restarted gateway reads its sandboxes back. A fleet
store (Redis) implements the same coroutines against a shared service; node
liveness is part of the interface so that the core never asks which store it
has.
"""

from __future__ import annotations

import abc
from typing import Dict, List, Optional

from ..core.record import NotebookSessionRecord, SandboxRecord, TenantRecord
from ..core.states import State


class SessionStore(abc.ABC):
    node: str

    @abc.abstractmethod
    async def get(self, sandbox_id: str) -> Optional[SandboxRecord]: ...

    @abc.abstractmethod
    async def put(self, record: SandboxRecord) -> SandboxRecord:
        """Write unconditionally (create, or a change that needs no agreement);
        returns the record with its new version."""

    @abc.abstractmethod
    async def compare_and_set(self, record: SandboxRecord, expected: State) -> bool:
        """Write ``record`` only if the stored state is still ``expected``,
        atomically; False (and nothing written) otherwise."""

    @abc.abstractmethod
    async def delete(self, sandbox_id: str) -> None: ...

    @abc.abstractmethod
    async def list(self, node: Optional[str] = None) -> List[SandboxRecord]: ...

    # Tenants: one record per name (core/record.py TenantRecord, with the
    # token's keyed hash, never the token). A fleet store shares them across
    # nodes; ``create_tenant`` must be atomic (Redis: SET NX / HSETNX).
    @abc.abstractmethod
    async def create_tenant(self, record: TenantRecord) -> bool:
        """Write ``record`` if no tenant has its name; False (nothing written) otherwise."""

    @abc.abstractmethod
    async def get_tenant(self, name: str) -> Optional[TenantRecord]: ...

    @abc.abstractmethod
    async def list_tenants(self) -> List[TenantRecord]: ...

    @abc.abstractmethod
    async def replace_tenant(self, record: TenantRecord, token_hash: str) -> bool:
        """Overwrite the tenant's record only if its stored ``token_hash`` is still
        the one given, atomically (a token check rehashing it, core/tenants.py);
        False (nothing written) otherwise."""

    @abc.abstractmethod
    async def delete_tenant(self, name: str) -> bool:
        """Remove it; False if there was none."""

    # Jupyter sessions (/api/sessions), scoped by owner. An owner's path is
    # held by one session at most: ``put_session`` takes it atomically (SQLite:
    # a unique constraint; Redis: one Lua script), never read-then-write.
    @abc.abstractmethod
    async def put_session(self, record: NotebookSessionRecord) -> bool:
        """Create or replace ``record`` (its owner never changes); False (nothing
        written) if another of the owner's sessions holds its path."""

    @abc.abstractmethod
    async def get_session(self, session_id: str) -> Optional[NotebookSessionRecord]: ...

    @abc.abstractmethod
    async def session_by_path(self, owner: str, path: str) -> Optional[NotebookSessionRecord]: ...

    @abc.abstractmethod
    async def list_sessions(self, owner: Optional[str] = None) -> List[NotebookSessionRecord]:
        """An owner's sessions; every owner's with None (the admin)."""

    @abc.abstractmethod
    async def delete_session(self, session_id: str) -> bool:
        """Remove it and free its path; False if there was none."""

    async def reseal(self) -> int:
        """Check the store's sealing key (store/seal.py) and rewrite records whose secret values are
        stored in clear (from before sealing), sealed: the number rewritten. SealError: another key."""
        return 0

    # Node liveness. The embedded store has one node, alive while it runs.
    async def heartbeat(self, node: str, ttl: float, info: Optional[dict] = None) -> None:
        return None

    async def live_nodes(self) -> Dict[str, dict]:
        return {self.node: {}}

    async def retire(self, node: str) -> None:
        """``node`` is going away (drained): not live from now on."""
        return None

    async def close(self) -> None:
        return None

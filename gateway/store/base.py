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

from ..core.record import SandboxRecord
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

    # Node liveness. The embedded store has one node, alive while it runs.
    async def heartbeat(self, node: str, ttl: float, info: Optional[dict] = None) -> None:
        return None

    async def live_nodes(self) -> Dict[str, dict]:
        return {self.node: {}}

    async def close(self) -> None:
        return None

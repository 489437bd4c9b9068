"""The embedded routing store: kernel id -> where its sandbox lives.

One process, no services. A store for several gateway nodes implements the
same four coroutines against a shared service.
"""

from __future__ import annotations

from typing import Dict, Optional


class MemoryStore:
    def __init__(self, node: str = "local"):
        self.node = node
        self._data: Dict[str, dict] = {}

    async def put(self, kernel_id: str, record: dict) -> None:
        self._data[kernel_id] = {**record, "node": self.node}

    async def get(self, kernel_id: str) -> Optional[dict]:
        return self._data.get(kernel_id)

    async def delete(self, kernel_id: str) -> None:
        self._data.pop(kernel_id, None)

    async def list(self) -> Dict[str, dict]:
        return dict(self._data)

"""jupyter_server's sessions: a notebook path bound to a kernel.

Sessions are records of the session store (store/base.py), so every node of a
fleet answers for all of them and a restarted gateway still has them. Each
belongs to the tenant that made it ("" for the admin): a tenant sees its own
only, the admin all. A session whose kernel was deleted, culled or found dead
is removed when it is next read, so readers never answer with a dead kernel.

Starting and deleting the kernel itself is the caller's (``Kernels``): on a
fleet a kernel may live on another node, and reaching it is the API layer's job.
"""

from __future__ import annotations

import uuid
from typing import Callable, List, Optional, Protocol

from .errors import Conflict, NotFound
from .messages import iso_epoch
from .record import NotebookSessionRecord, SandboxRecord
from .states import State
from .tenants import Principal


class Kernels(Protocol):
    """What sessions need of kernels, wherever they run."""

    async def start(self, name: Optional[str]) -> str: ...  # the new kernel's id

    async def delete(self, kernel_id: str) -> None: ...  # gone already is fine


def record_model(rec: SandboxRecord) -> dict:
    """The Jupyter kernel model of a kernel on another node, from its record
    (no live activity or connection count here: its node has those)."""
    m = {"id": rec.id, "name": rec.kernel_name, "last_activity": iso_epoch(rec.created),
         "execution_state": "idle" if rec.state == State.RUNNING else rec.state.value, "connections": 0,
         "driver": rec.driver, "created": iso_epoch(rec.created), "node": rec.node}
    if rec.expires:
        m["expires"] = iso_epoch(rec.expires)
    if rec.reason:
        m["reason"] = rec.reason
    return m


class NotebookSessions:
    def __init__(self, store, local: Callable[[str], Optional[object]]):
        """``local(kernel_id)``: this node's live sandbox of that id, or None."""
        self.store = store
        self.local = local

    async def kernel_model(self, kernel_id: str) -> Optional[dict]:
        """The kernel's model, wherever it runs; None if it is gone or dead."""
        sb = self.local(kernel_id)
        if sb is not None:
            return None if sb.state == State.DEAD else sb.model()
        rec = await self.store.get(kernel_id)
        return None if rec is None or rec.state == State.DEAD else record_model(rec)

    async def kernel_visible(self, kernel_id: str, who: Principal) -> bool:
        """Whether ``who`` may bind a session to the kernel, on any node."""
        sb = self.local(kernel_id)
        rec = sb.record if sb is not None else await self.store.get(kernel_id)
        return rec is not None and who.sees(rec.owner)

    async def model(self, s: NotebookSessionRecord) -> Optional[dict]:
        """The session's answer; None (and the record removed) once its kernel is gone."""
        kernel = await self.kernel_model(s.kernel_id)
        if kernel is None:
            await self.store.delete_session(s.id)
            return None
        return {"id": s.id, "path": s.path, "name": s.name, "type": s.type, "kernel": kernel,
                "notebook": {"path": s.path, "name": s.name}}

    async def list(self, who: Principal) -> List[dict]:
        records = await self.store.list_sessions(None if who.admin else who.owner)
        return [m for m in [await self.model(s) for s in records] if m is not None]

    async def _kernel_for(self, who: Principal, kernels: Kernels, kernel_id: Optional[str],
                          kernel_name: Optional[str]) -> str:
        if kernel_id:
            if not await self.kernel_visible(kernel_id, who):
                raise NotFound(f"Kernel does not exist: {kernel_id}")
            return kernel_id
        return await kernels.start(kernel_name)

    async def create(self, who: Principal, kernels: Kernels, path: str, kind: str, name: str = "",
                     kernel_id: Optional[str] = None, kernel_name: Optional[str] = None) -> dict:
        """A session for ``path`` (jupyter_server answers a POST for a path that has
        a live session with that session), bound to ``kernel_id`` or a new kernel."""
        existing = await self.store.session_by_path(who.owner, path)
        m = await self.model(existing) if existing else None
        if m is not None:
            return m
        kid = await self._kernel_for(who, kernels, kernel_id, kernel_name)
        rec = NotebookSessionRecord(id=str(uuid.uuid4()), owner=who.owner, path=path, name=name,
                                    type=kind, kernel_id=kid)
        if not await self.store.put_session(rec):
            # Another request (on any node) took the path meanwhile: answer with its session.
            if not kernel_id:
                await kernels.delete(kid)
            existing = await self.store.session_by_path(who.owner, path)
            m = await self.model(existing) if existing else None
            if m is None:
                raise Conflict(f"Path {path} is taken by another session")
            return m
        return await self.model(rec)

    async def get_record(self, sid: str, who: Principal) -> NotebookSessionRecord:
        s = await self.store.get_session(sid)
        if s is None or not who.sees(s.owner) or await self.kernel_model(s.kernel_id) is None:
            if s is not None and who.sees(s.owner):
                await self.store.delete_session(sid)  # its kernel is gone
            raise NotFound(f"Session not found: {sid}")
        return s

    async def get(self, sid: str, who: Principal) -> dict:
        return await self.model(await self.get_record(sid, who))

    async def update(self, sid: str, who: Principal, kernels: Kernels, changes: dict,
                     kernel_id: Optional[str] = None, kernel_name: Optional[str] = None) -> dict:
        """``changes``: new path, name or type. A new ``kernel_name`` starts a kernel and
        deletes the old one once the session points at the new one."""
        s = await self.get_record(sid, who)
        old_kernel = None
        if kernel_id:
            changes["kernel_id"] = await self._kernel_for(who, kernels, kernel_id, None)
        elif kernel_name:
            old_kernel = s.kernel_id
            changes["kernel_id"] = await kernels.start(kernel_name)
        new = s.model_copy(update=changes)
        if not await self.store.put_session(new):
            if old_kernel:
                await kernels.delete(new.kernel_id)
            raise Conflict(f"Path {new.path} is taken by another session; "
                           "delete that session first or pick another path")
        if old_kernel:
            await kernels.delete(old_kernel)
        return await self.model(new)

    async def delete(self, sid: str, who: Principal, kernels: Kernels) -> None:
        s = await self.get_record(sid, who)
        await self.store.delete_session(sid)
        await kernels.delete(s.kernel_id)


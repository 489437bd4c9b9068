"""The Jupyter Kernel Gateway REST API: kernels, kernelspecs, sessions.

Shapes and status codes follow Jupyter Kernel Gateway 3.0 / jupyter_server 2
(see docs/api.md), with their known defects fixed: an unknown kernel name is
404 rather than a 500 with a traceback, the kernel list is open by default,
OPTIONS needs no token, and sessions honour max_kernels.
Sessions are store records, shared by a fleet and kept across restarts.
"""

from __future__ import annotations

import uuid
from typing import Dict, List, Optional

from pydantic import BaseModel, ConfigDict
from tornado import httpclient, web

from .. import __version__
from ..core.errors import NotFound
from ..core.messages import iso_epoch
from ..core.record import NotebookSessionRecord, SandboxRecord
from ..core.states import State
from ..core.service import StartRequest
from ..core.tenants import Principal
from .base import APIHandler, error, not_found
from .forward import headers_for

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


class KernelCreate(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients also send "path"
    name: Optional[str] = None
    env: Optional[Dict[str, str]] = None


class SessionKernel(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Optional[str] = None
    id: Optional[str] = None


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="allow")
    path: Optional[str] = None
    name: Optional[str] = None
    type: Optional[str] = None
    kernel: Optional[SessionKernel] = None


class MainHandler(APIHandler):
    def get(self):
        self.reply({"version": __version__})


class KernelSpecsHandler(APIHandler):
    def get(self):
        self.reply(self.service.kernelspecs())


class KernelSpecHandler(APIHandler):
    def get(self, name):
        self.reply(self.service.kernelspec(name))


class KernelSpecResourceHandler(APIHandler):
    def get(self, name, path):
        # Sandgate kernelspecs carry no logo files; say so precisely.
        self.service.kernelspec(name)
        raise not_found(f"Kernel spec {name} has no resource {path}")


async def start_kernel(handler: APIHandler, name: Optional[str], env: Optional[dict]):
    return await handler.service.start(StartRequest(kernel_name=name, env=env or {}), handler.who)


def kernel(handler: APIHandler, kernel_id: str):
    """Jupyter's wording for an unknown kernel (or another tenant's)."""
    try:
        return handler.service.get(kernel_id, handler.who)
    except NotFound:
        raise not_found(f"Kernel does not exist: {kernel_id}") from None


class KernelsHandler(APIHandler):
    async def get(self):
        await self.reply_list([k.model() for k in self.service.list(self.who)])

    async def post(self):
        if await self.placed_elsewhere():
            return
        body = self.body(KernelCreate)
        k = await start_kernel(self, body.name, body.env)
        self.set_header("Location", f"/api/kernels/{k.id}")
        self.reply(k.model(), 201)


class KernelHandler(APIHandler):
    def get(self, kernel_id):
        self.reply(kernel(self, kernel_id).model())

    async def delete(self, kernel_id):
        kernel(self, kernel_id)
        await self.service.delete(kernel_id, self.who)
        self.set_status(204)
        self.finish()


class KernelActionHandler(APIHandler):
    async def post(self, kernel_id, action):
        kernel(self, kernel_id)
        if action == "interrupt":
            await self.service.interrupt(kernel_id, self.who)
            self.set_status(204)
            return self.finish()
        self.reply((await self.service.restart(kernel_id, self.who)).model())


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


class SessionsHandler(APIHandler):
    """jupyter_server's sessions: a notebook path bound to a kernel, kept as
    records of the session store (store/base.py), so every node of a fleet
    answers for all of them and a restarted gateway still has them. Each
    belongs to the tenant that made it ("" for the admin): a tenant sees its
    own only, the admin all."""

    @property
    def store(self):
        return self.service.manager.store

    async def kernel_model(self, kernel_id: str) -> Optional[dict]:
        """The kernel's model, wherever it runs; None if it is gone or dead."""
        sb = self.service.manager.sandboxes.get(kernel_id)
        if sb is not None:
            return None if sb.state == State.DEAD else sb.model()
        rec = await self.store.get(kernel_id)
        return None if rec is None or rec.state == State.DEAD else record_model(rec)

    async def model(self, s: NotebookSessionRecord) -> Optional[dict]:
        """The session's answer; None (and the record removed) once its kernel
        was deleted, culled or found dead."""
        kernel = await self.kernel_model(s.kernel_id)
        if kernel is None:
            await self.store.delete_session(s.id)
            return None
        return {"id": s.id, "path": s.path, "name": s.name, "type": s.type, "kernel": kernel,
                "notebook": {"path": s.path, "name": s.name}}

    async def live(self) -> List[dict]:
        records = await self.store.list_sessions(None if self.who.admin else self.who.owner)
        return [m for m in [await self.model(s) for s in records] if m is not None]

    async def check_kernel(self, kernel_id: str) -> None:
        """A kernel the caller may bind a session to, on any node."""
        if kernel_id in self.service.manager.sandboxes:
            kernel(self, kernel_id)
            return
        rec = await self.store.get(kernel_id)
        if rec is None or not self.who.sees(rec.owner):
            raise not_found(f"Kernel does not exist: {kernel_id}")

    async def delete_kernel(self, kernel_id: str) -> None:
        """Stop the kernel on its own node (forwarded there if not this one)."""
        fleet = self.settings.get("fleet")
        peer = await fleet.locate(kernel_id, self.who) if fleet is not None else None
        if peer is None:
            try:
                await self.service.delete(kernel_id, self.who)
            except NotFound:
                pass
            return
        uri = f"/api/kernels/{kernel_id}"
        r = await httpclient.AsyncHTTPClient().fetch(
            peer.url.rstrip("/") + uri, method="DELETE", headers=headers_for(self, peer, "DELETE", uri),
            raise_error=False, request_timeout=60)
        if r.code not in (204, 404):
            raise error(502, f"could not delete kernel {kernel_id} on its node ({peer.url}): HTTP {r.code}")

    async def new_kernel(self, name: Optional[str]) -> str:
        if name and name not in self.service.manager.specs.specs:
            raise error(501, f"The '{name}' kernel is not available. Please pick another suitable kernel instead, or install that kernel.")
        return (await start_kernel(self, name, None)).id

    async def get(self):
        self.reply(await self.live())

    async def post(self):
        body = self.body(SessionCreate)
        extra = body.model_extra or {}
        path = body.path or (extra.get("notebook") or {}).get("path")
        if not path:
            raise error(400, "Missing field in JSON data: path")
        kind = body.type or ("notebook" if extra.get("notebook") else None)
        if not kind:
            raise error(400, "Missing field in JSON data: type")
        # jupyter_server answers a POST for a path that has a session with that session.
        existing = await self.store.session_by_path(self.who.owner, path)
        m = await self.model(existing) if existing else None
        if m is not None:
            return self.reply(m, 201)
        spec = body.kernel or SessionKernel()
        if spec.id:
            await self.check_kernel(spec.id)
            kid = spec.id
        else:
            kid = await self.new_kernel(spec.name)
        rec = NotebookSessionRecord(id=str(uuid.uuid4()), owner=self.who.owner, path=path, name=body.name or "",
                                    type=kind, kernel_id=kid)
        if not await self.store.put_session(rec):
            # Another request (on any node) took the path meanwhile: answer with its session.
            if not spec.id:
                await self.delete_kernel(kid)
            existing = await self.store.session_by_path(self.who.owner, path)
            m = await self.model(existing) if existing else None
            if m is None:
                raise error(409, f"Path {path} is taken by another session")
            return self.reply(m, 201)
        self.set_header("Location", f"/api/sessions/{rec.id}")
        self.reply(await self.model(rec), 201)


class SessionHandler(SessionsHandler):
    async def session(self, sid) -> NotebookSessionRecord:
        s = await self.store.get_session(sid)
        if s is None or not self.who.sees(s.owner) or await self.kernel_model(s.kernel_id) is None:
            if s is not None and self.who.sees(s.owner):
                await self.store.delete_session(sid)  # its kernel is gone
            raise not_found(f"Session not found: {sid}")
        return s

    async def get(self, sid):
        self.reply(await self.model(await self.session(sid)))

    async def patch(self, sid):
        s = await self.session(sid)
        body = self.body(SessionCreate)
        changes = {k: getattr(body, k) for k in ("path", "name", "type") if getattr(body, k) is not None}
        old_kernel = None
        if body.kernel and body.kernel.id:
            await self.check_kernel(body.kernel.id)
            changes["kernel_id"] = body.kernel.id
        elif body.kernel and body.kernel.name:
            old_kernel = s.kernel_id
            changes["kernel_id"] = await self.new_kernel(body.kernel.name)
        new = s.model_copy(update=changes)
        if not await self.store.put_session(new):
            if old_kernel:
                await self.delete_kernel(new.kernel_id)
            raise error(409, f"Path {new.path} is taken by another session; "
                             "delete that session first or pick another path")
        if old_kernel:
            await self.delete_kernel(old_kernel)
        self.reply(await self.model(new))

    async def delete(self, sid):
        s = await self.session(sid)
        await self.store.delete_session(sid)
        await self.delete_kernel(s.kernel_id)
        self.set_status(204)
        self.finish()


def routes() -> list:
    return [
        (r"/api/?", MainHandler),
        (r"/api/kernelspecs/?", KernelSpecsHandler),
        (r"/api/kernelspecs/([^/]+)/?", KernelSpecHandler),
        (r"/kernelspecs/([^/]+)/(.+)", KernelSpecResourceHandler),
        (r"/api/kernels/?", KernelsHandler),
        (rf"/api/kernels/({UUID})/?", KernelHandler),
        (rf"/api/kernels/({UUID})/(interrupt|restart)/?", KernelActionHandler),
        (r"/api/sessions/?", SessionsHandler),
        (rf"/api/sessions/({UUID})/?", SessionHandler),
    ]


class NotFoundHandler(APIHandler):
    async def prepare(self):
        await super().prepare()
        raise web.HTTPError(404, "%s", f"No such endpoint: {self.request.path}")

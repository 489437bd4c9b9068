"""The Jupyter Kernel Gateway REST API: kernels, kernelspecs, sessions.

Shapes and status codes follow Jupyter Kernel Gateway 3.0 / jupyter_server 2
(see docs/api.md), with their known defects fixed: an unknown kernel name is
404 rather than a 500 with a traceback, the kernel list is open by default,
OPTIONS needs no token, and sessions honour max_kernels.
"""

from __future__ import annotations

import uuid
from typing import Dict, List, Optional

from pydantic import BaseModel, ConfigDict
from tornado import web

from .. import __version__
from ..core.errors import NotFound
from ..core.service import StartRequest
from ..core.tenants import Principal
from .base import APIHandler, error, not_found

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


class NotebookSessions:
    """jupyter_server's session records: a notebook path bound to a kernel.
    Each belongs to the tenant that made it ("" for the admin); a tenant sees
    its own only, the admin all."""

    def __init__(self):
        self.sessions: Dict[str, dict] = {}

    def model(self, sid: str, service) -> Optional[dict]:
        s = self.sessions[sid]
        try:
            kernel = service.get(s["kernel_id"]).model()
        except NotFound:
            return None
        return {"id": sid, "path": s["path"], "name": s["name"], "type": s["type"], "kernel": kernel,
                "notebook": {"path": s["path"], "name": s["name"]}}

    def live(self, service, who: Principal) -> List[dict]:
        out = []
        for sid in list(self.sessions):
            m = self.model(sid, service)
            if m is None:  # its kernel was deleted or culled
                del self.sessions[sid]
            elif who.sees(self.sessions[sid]["owner"]):
                out.append(m)
        return out


class SessionsHandler(APIHandler):
    @property
    def store(self) -> NotebookSessions:
        return self.settings["notebook_sessions"]

    def get(self):
        self.reply(self.store.live(self.service, self.who))

    async def post(self):
        body = self.body(SessionCreate)
        extra = body.model_extra or {}
        path = body.path or (extra.get("notebook") or {}).get("path")
        if not path:
            raise error(400, "Missing field in JSON data: path")
        kind = body.type or ("notebook" if extra.get("notebook") else None)
        if not kind:
            raise error(400, "Missing field in JSON data: type")
        for m in self.store.live(self.service, self.who):
            if m["path"] == path and self.store.sessions[m["id"]]["owner"] == self.who.owner:
                return self.reply(m, 201)
        spec = body.kernel or SessionKernel()
        if spec.id:
            k = kernel(self, spec.id)
        else:
            if spec.name and spec.name not in self.service.manager.specs.specs:
                raise error(501, f"The '{spec.name}' kernel is not available. Please pick another suitable kernel instead, or install that kernel.")
            k = await start_kernel(self, spec.name, None)
        sid = str(uuid.uuid4())
        self.store.sessions[sid] = {"path": path, "name": body.name or "", "type": kind, "kernel_id": k.id,
                                    "owner": self.who.owner}
        self.set_header("Location", f"/api/sessions/{sid}")
        self.reply(self.store.model(sid, self.service), 201)


class SessionHandler(SessionsHandler):
    def session(self, sid):
        if (sid not in self.store.sessions or not self.who.sees(self.store.sessions[sid]["owner"])
                or self.store.model(sid, self.service) is None):
            raise not_found(f"Session not found: {sid}")
        return self.store.sessions[sid]

    def get(self, sid):
        self.session(sid)
        self.reply(self.store.model(sid, self.service))

    async def patch(self, sid):
        s = self.session(sid)
        body = self.body(SessionCreate)
        for key in ("path", "name", "type"):
            if getattr(body, key) is not None:
                s[key] = getattr(body, key)
        if body.kernel and body.kernel.id:
            kernel(self, body.kernel.id)
            s["kernel_id"] = body.kernel.id
        elif body.kernel and body.kernel.name:
            old = s["kernel_id"]
            s["kernel_id"] = (await start_kernel(self, body.kernel.name, None)).id
            await self.service.delete(old, self.who)
        self.reply(self.store.model(sid, self.service))

    async def delete(self, sid):
        s = self.session(sid)
        del self.store.sessions[sid]
        try:
            await self.service.delete(s["kernel_id"], self.who)
        except NotFound:
            pass
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

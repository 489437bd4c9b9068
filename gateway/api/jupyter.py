"""The Jupyter Kernel Gateway REST API: kernels, kernelspecs, sessions.

Shapes and status codes follow Jupyter Kernel Gateway 3.0 / jupyter_server 2
(see docs/api.md), with their known defects fixed: an unknown kernel name is
404 rather than a 500 with a traceback, the kernel list is open by default,
OPTIONS needs no token, and sessions honour max_kernels.
Sessions are store records, shared by a fleet and kept across restarts.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from pydantic import BaseModel, ConfigDict
from tornado import httpclient, web

from .. import __version__
from ..core.errors import NotFound
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


class NodeKernels:
    """Starting and deleting the kernels sessions are bound to, for one request: a kernel
    on another node of a fleet is deleted there (core/sessions.py's ``Kernels``)."""

    def __init__(self, handler: APIHandler):
        self.handler = handler

    async def start(self, name: Optional[str]) -> str:
        if name and not self.handler.service.has_kernelspec(name):
            raise error(501, f"The '{name}' kernel is not available. Please pick another suitable kernel instead, or install that kernel.")
        return (await start_kernel(self.handler, name, None)).id

    async def delete(self, kernel_id: str) -> None:
        h = self.handler
        fleet = h.settings.get("fleet")
        peer = await fleet.locate(kernel_id, h.who) if fleet is not None else None
        if peer is None:
            try:
                await h.service.delete(kernel_id, h.who)
            except NotFound:
                pass
            return
        uri = f"/api/kernels/{kernel_id}"
        r = await httpclient.AsyncHTTPClient().fetch(
            peer.url.rstrip("/") + uri, method="DELETE", headers=headers_for(h, peer, "DELETE", uri),
            raise_error=False, request_timeout=60)
        if r.code not in (204, 404):
            raise error(502, f"could not delete kernel {kernel_id} on its node ({peer.url}): HTTP {r.code}")


class SessionsHandler(APIHandler):
    """jupyter_server's sessions (core/sessions.py keeps them)."""

    @property
    def sessions(self):
        return self.service.sessions

    async def get(self):
        self.reply(await self.sessions.list(self.who))

    async def post(self):
        body = self.body(SessionCreate)
        extra = body.model_extra or {}
        path = body.path or (extra.get("notebook") or {}).get("path")
        if not path:
            raise error(400, "Missing field in JSON data: path")
        kind = body.type or ("notebook" if extra.get("notebook") else None)
        if not kind:
            raise error(400, "Missing field in JSON data: type")
        spec = body.kernel or SessionKernel()
        m = await self.sessions.create(self.who, NodeKernels(self), path, kind, body.name or "",
                                       kernel_id=spec.id, kernel_name=spec.name)
        self.set_header("Location", f"/api/sessions/{m['id']}")
        self.reply(m, 201)


class SessionHandler(SessionsHandler):
    async def get(self, sid):
        self.reply(await self.sessions.get(sid, self.who))

    async def patch(self, sid):
        body = self.body(SessionCreate)
        changes = {k: getattr(body, k) for k in ("path", "name", "type") if getattr(body, k) is not None}
        kernel = body.kernel or SessionKernel()
        self.reply(await self.sessions.update(sid, self.who, NodeKernels(self), changes,
                                              kernel_id=kernel.id, kernel_name=kernel.name))

    async def delete(self, sid):
        await self.sessions.delete(sid, self.who, NodeKernels(self))
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

"""The sandbox API for agents and tools, beside the Jupyter API.

A sandbox and its Jupyter kernel are one thing with one id: a kernel started
through /api/kernels is a sandbox here, and a fork made here is a kernel
there, reachable through /api/kernels/{id}/channels.
"""

from __future__ import annotations

import json
from typing import Dict, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..agent_link import AgentError
from ..drivers.base import Limits, SandboxError
from ..sessions import LimitReached, NoSuchKernel
from .base import APIHandler, error, not_found
from .jupyter import UUID


class SandboxCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    driver: Optional[str] = Field(None, description="sandbox driver; the server default when omitted")
    env: Dict[str, str] = Field({}, description="KERNEL_* (and allow-listed) variables for the sandbox")
    labels: Dict[str, str] = {}
    limits: Optional[Limits] = None
    ttl: Optional[float] = Field(None, gt=0, description="seconds until the sandbox is deleted")
    checkpoint: Optional[str] = Field(None, description="start from this checkpoint instead of cold")


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    timeout: float = Field(60, gt=0, le=3600)


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: Optional[str] = Field(None, description="fork from this checkpoint; from now when omitted")


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("", max_length=200)


class Empty(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # disk: checkpoint and stop (memory freed, resume ~1 s); memory: frozen in place (resume in ms)
    mode: Literal["disk", "memory"] = "disk"


class Output(BaseModel):
    type: str  # stream | execute_result | display_data | error
    name: Optional[str] = None
    text: Optional[str] = None
    data: Optional[Dict[str, object]] = None  # mime -> value; image/png is base64
    ename: Optional[str] = None
    evalue: Optional[str] = None
    traceback: Optional[List[str]] = None


class ExecuteResult(BaseModel):
    status: str  # ok | error | timeout
    execution_count: Optional[int]
    outputs: List[Output]
    stdout: str
    stderr: str
    error: Optional[Output]


class SandboxModel(BaseModel):
    id: str
    state: str  # starting | running | paused | dead
    pause_mode: Optional[str] = None  # disk | memory, while paused
    execution_state: str
    driver: str
    kernel_id: str
    runtime_id: Optional[str]  # the driver's name for the running sandbox (runsc list), none while paused
    parent: Optional[Dict[str, Optional[str]]]  # {"sandbox", "checkpoint"} it was forked from
    head: Optional[str]  # newest checkpoint in its line
    labels: Dict[str, str]
    created: str
    last_activity: str
    expires: Optional[str] = None
    reason: Optional[str] = None


def sandbox_model(kernel) -> dict:
    m = kernel.model()
    state = {"paused": "paused", "dead": "dead", "starting": "starting"}.get(kernel.execution_state, "running")
    parent = None
    if kernel.origin:
        cp = kernel.manager.checkpoints.get(kernel.origin)
        parent = {"sandbox": cp.sandbox, "checkpoint": cp.id}
    return SandboxModel(id=kernel.id, state=state, pause_mode=kernel.pause_mode,
                        execution_state=kernel.execution_state, driver=kernel.driver,
                        kernel_id=kernel.id, runtime_id=kernel.sandbox.id if kernel.sandbox else None, parent=parent, head=kernel.head, labels=kernel.labels,
                        created=m["created"], last_activity=m["last_activity"], expires=m.get("expires"),
                        reason=m.get("reason")).model_dump()


class SandboxBase(APIHandler):
    def kernel(self, sid):
        try:
            return self.km.get(sid)
        except NoSuchKernel:
            raise not_found(f"Sandbox does not exist: {sid}") from None

    async def guarded(self, coro):
        """Driver and agent failures become clear JSON errors."""
        try:
            return await coro
        except KeyError as e:
            raise not_found(f"No such checkpoint: {e.args[0]}") from None
        except LimitReached:
            raise error(403, "Resource Limit") from None
        except AgentError as e:
            raise error(409, str(e)) from None
        except SandboxError as e:
            raise error(500, str(e)) from None
        except FileNotFoundError as e:
            raise error(500, str(e)) from None


class SandboxesHandler(SandboxBase):
    def get(self):
        self.reply([sandbox_model(k) for k in self.km.list()])

    async def post(self):
        body = self.body(SandboxCreate)
        name = None
        if body.driver:
            name = f"python3-{body.driver}"
            if name not in self.km.specs.specs:
                raise error(400, f"unknown or unavailable driver {body.driver!r}")
        kernel = await self.guarded(self.km.start(name, body.env, checkpoint=body.checkpoint, labels=body.labels,
                                                  limits=body.limits, ttl=body.ttl))
        self.set_header("Location", f"/api/sandboxes/{kernel.id}")
        self.reply(sandbox_model(kernel), 201)


class SandboxHandler(SandboxBase):
    def get(self, sid):
        self.reply(sandbox_model(self.kernel(sid)))

    async def delete(self, sid):
        self.kernel(sid)
        try:
            await self.km.shutdown(sid)
        except NoSuchKernel:
            raise not_found(f"Sandbox does not exist: {sid}") from None
        self.set_status(204)
        self.finish()


class ExecuteHandler(SandboxBase):
    """JSON by default; with ``Accept: text/event-stream`` (or ``?stream=1``) a
    server-sent event per output as it happens, then one ``result`` event."""

    async def post(self, sid):
        body = self.body(ExecuteRequest)
        kernel = self.kernel(sid)
        stream = "text/event-stream" in self.request.headers.get("Accept", "") or self.get_query_argument("stream", "") in ("1", "true")
        if not stream:
            return self.reply(await self.guarded(kernel.execute(body.code, body.timeout)))
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")

        async def emit(event: str, data: dict) -> None:
            self.write(f"event: {event}\ndata: {json.dumps(data)}\n\n")
            await self.flush()

        try:
            result = await kernel.execute(body.code, body.timeout, on_output=lambda o: emit("output", o))
        except Exception as e:  # headers are sent: the error travels as an event
            await emit("error", {"message": str(e) or type(e).__name__})
        else:
            await emit("result", result)
        self.finish()


class ActionHandler(SandboxBase):
    async def post(self, sid, action):
        kernel = self.kernel(sid)
        if action == "pause":
            await self.guarded(kernel.pause(self.body(PauseRequest).mode))
        else:
            self.body(Empty)  # no fields, but malformed JSON is still a 400
            await self.guarded(kernel.resume())
        self.reply(sandbox_model(kernel))


class CheckpointsHandler(SandboxBase):
    def get(self, sid):
        self.kernel(sid)
        self.reply([c.summary() for c in self.km.checkpoints.list(sandbox=sid)])

    async def post(self, sid):
        body = self.body(CheckpointRequest)
        kernel = self.kernel(sid)
        cp = await self.guarded(kernel.checkpoint(body.name))
        self.reply(cp.summary(), 201)


class ForkHandler(SandboxBase):
    async def post(self, sid):
        body = self.body(ForkRequest)
        self.kernel(sid)
        kernel = await self.guarded(self.km.fork(sid, body.checkpoint))
        self.set_header("Location", f"/api/sandboxes/{kernel.id}")
        self.reply(sandbox_model(kernel), 201)


class TreeHandler(SandboxBase):
    """Every checkpoint and fork, as nodes and parent links, for drawing."""

    def get(self):
        live = {k.id: k for k in self.km.list()}
        nodes = [{"kind": "checkpoint", **c.summary()} for c in self.km.checkpoints.list()]
        nodes += [{"kind": "sandbox", "id": k.id, "parent": k.origin, "state": sandbox_model(k)["state"]}
                  for k in live.values()]
        self.reply({"nodes": nodes})


class FilesHandler(SandboxBase):
    async def get(self, sid, path):
        kernel = self.kernel(sid)
        link = await self.link(kernel)
        try:
            listing, _ = await link.request("file_list", {"path": path})
            return self.reply(listing)
        except AgentError as e:
            if "NotADirectoryError" not in str(e):
                raise self.file_error(e, path) from None
        try:
            _, data = await link.request("file_read", {"path": path})
        except AgentError as e:
            raise self.file_error(e, path) from None
        self.set_header("Content-Type", "application/octet-stream")
        self.finish(data)

    async def put(self, sid, path):
        kernel = self.kernel(sid)
        if not path or path.endswith("/"):
            raise error(400, "a file path is required")
        link = await self.link(kernel)
        try:
            result, _ = await link.request("file_write", {"path": path}, self.request.body)
        except AgentError as e:
            raise self.file_error(e, path) from None
        self.reply({"path": path, **result}, 201)

    async def delete(self, sid, path):
        kernel = self.kernel(sid)
        link = await self.link(kernel)
        try:
            await link.request("file_delete", {"path": path})
        except AgentError as e:
            raise self.file_error(e, path) from None
        self.set_status(204)
        self.finish()

    async def link(self, kernel):
        await self.guarded(kernel.ensure_running())
        return kernel.link

    @staticmethod
    def file_error(e: AgentError, path: str):
        text = str(e)
        if "FileNotFoundError" in text:
            return not_found(f"No such file: {path}")
        if "outside the workspace" in text or "refusing" in text:
            return error(403, text.split(": ", 1)[-1])
        if "IsADirectoryError" in text or "NotADirectoryError" in text:
            return error(400, text.split(": ", 1)[-1])
        return error(500, text)


class OpenAPIHandler(APIHandler):
    def get(self):
        self.reply(openapi())


def openapi() -> dict:
    models = [SandboxCreate, SandboxModel, ExecuteRequest, ExecuteResult, ForkRequest, CheckpointRequest, PauseRequest]
    defs = {}
    for m in models:
        schema = m.model_json_schema(ref_template="#/components/schemas/{model}")
        defs.update(schema.pop("$defs", {}))
        defs[m.__name__] = schema

    def ref(name):
        return {"$ref": f"#/components/schemas/{name}"}

    def body(name):
        return {"required": True, "content": {"application/json": {"schema": ref(name)}}}

    def resp(code, name=None, desc="OK"):
        r = {"description": desc}
        if name:
            r["content"] = {"application/json": {"schema": ref(name)}}
        return {str(code): r, "4XX": {"description": 'JSON error {"reason", "message"}'}}

    sid = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
    fpath = sid + [{"name": "path", "in": "path", "required": True, "schema": {"type": "string"}}]
    paths = {
        "/api/sandboxes": {
            "get": {"summary": "List sandboxes", "responses": resp(200)},
            "post": {"summary": "Create a sandbox", "requestBody": body("SandboxCreate"),
                     "responses": resp(201, "SandboxModel", "Created")}},
        "/api/sandboxes/{id}": {
            "get": {"parameters": sid, "responses": resp(200, "SandboxModel")},
            "delete": {"parameters": sid, "responses": resp(204, desc="Deleted")}},
        "/api/sandboxes/{id}/execute": {"post": {
            "parameters": sid, "requestBody": body("ExecuteRequest"),
            "summary": "Run code; with Accept: text/event-stream, `output` events as they happen, then `result`",
            "responses": resp(200, "ExecuteResult")}},
        "/api/sandboxes/{id}/pause": {"post": {"parameters": sid, "requestBody": body("PauseRequest"),
                                               "responses": resp(200, "SandboxModel")}},
        "/api/sandboxes/{id}/resume": {"post": {"parameters": sid, "responses": resp(200, "SandboxModel")}},
        "/api/sandboxes/{id}/checkpoints": {
            "get": {"parameters": sid, "responses": resp(200)},
            "post": {"parameters": sid, "requestBody": body("CheckpointRequest"), "responses": resp(201)}},
        "/api/sandboxes/{id}/fork": {"post": {"parameters": sid, "requestBody": body("ForkRequest"),
                                              "responses": resp(201, "SandboxModel", "Created")}},
        "/api/sandboxes/{id}/files/{path}": {
            "get": {"parameters": fpath, "summary": "File bytes, or a JSON listing for a directory",
                    "responses": resp(200)},
            "put": {"parameters": fpath, "requestBody": {"content": {"application/octet-stream": {}}},
                    "responses": resp(201)},
            "delete": {"parameters": fpath, "responses": resp(204, desc="Deleted")}},
        "/api/sandboxes/tree": {"get": {"summary": "All checkpoints and sandboxes with parent links",
                                        "responses": resp(200)}},
    }
    from .. import __version__

    return {"openapi": "3.0.3", "info": {"title": "Sandgate sandbox API", "version": __version__},
            "components": {"schemas": defs,
                           "securitySchemes": {"token": {"type": "apiKey", "in": "header", "name": "Authorization"}}},
            "security": [{"token": []}], "paths": paths}


def routes() -> list:
    return [
        (r"/api/sandboxes/openapi.json", OpenAPIHandler),
        (r"/api/sandboxes/tree", TreeHandler),
        (r"/api/sandboxes/?", SandboxesHandler),
        (rf"/api/sandboxes/({UUID})/?", SandboxHandler),
        (rf"/api/sandboxes/({UUID})/execute", ExecuteHandler),
        (rf"/api/sandboxes/({UUID})/(pause|resume)", ActionHandler),
        (rf"/api/sandboxes/({UUID})/checkpoints/?", CheckpointsHandler),
        (rf"/api/sandboxes/({UUID})/fork", ForkHandler),
        (rf"/api/sandboxes/({UUID})/files/?(.*)", FilesHandler),
    ]


"""The sandbox API for agents and tools, beside the Jupyter API.

A sandbox and its Jupyter kernel are one thing with one id: a kernel started
through /api/kernels is a sandbox here, and a fork made here is a kernel
there, reachable through /api/kernels/{id}/channels.
"""

from __future__ import annotations

import json
from typing import Dict, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field
from tornado import web

from ..core.errors import BadRequest
from ..core.executions import ID_PATTERN
from ..egress.policy import EgressPolicy
from ..core.service import SandboxCreate, SandboxModel, StartRequest, sandbox_model
from ..core.tenants import TenantCreate, TenantModel
from .base import APIHandler, BodyStream, code_bound
from .forward import forward_http
from .jupyter import UUID


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    timeout: float = Field(60, gt=0, le=3600)
    id: Optional[str] = Field(None, pattern=ID_PATTERN, description=(
        "an execution id (1-64 of A-Z a-z 0-9 . _ : -): a repeat of it joins the running execution or gets "
        "its stored result; the code runs at most once"))


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
    status: str  # ok | error | timeout | aborted
    execution_count: Optional[int]
    outputs: List[Output]
    stdout: str
    stderr: str
    error: Optional[Output]
    truncated: bool = False  # the cell wrote more than SANDGATE_EXECUTE_OUTPUT_MB: the rest was dropped


class SandboxesHandler(APIHandler):
    async def get(self):
        await self.reply_list([sandbox_model(sb) for sb in self.service.list(self.who)])

    async def post(self):
        if await self.placed_elsewhere():
            return
        body = self.body(SandboxCreate)
        sb = await self.service.start(StartRequest(**dict(body)), self.who)
        self.set_header("Location", f"/api/sandboxes/{sb.id}")
        self.reply(sandbox_model(sb), 201)


class SandboxHandler(APIHandler):
    def get(self, sid):
        self.reply(sandbox_model(self.service.get(sid, self.who)))

    async def delete(self, sid):
        await self.service.delete(sid, self.who)
        self.set_status(204)
        self.finish()


class ExecuteHandler(APIHandler):
    """JSON by default; with ``Accept: text/event-stream`` (or ``?stream=1``) a
    server-sent event per output as it happens, then one ``result`` event."""

    max_body = staticmethod(code_bound)

    async def post(self, sid):
        body = self.body(ExecuteRequest)
        self.request.body = b""  # parsed: the code is held once from here on, not twice
        self.service.get(sid, self.who)
        stream = "text/event-stream" in self.request.headers.get("Accept", "") or self.get_query_argument("stream", "") in ("1", "true")
        if not stream:
            return self.reply(await self.service.execute(sid, body.code, body.timeout, who=self.who,
                                                         execution_id=body.id))
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")

        async def emit(event: str, data: dict) -> None:
            self.write(f"event: {event}\ndata: {json.dumps(data)}\n\n")
            await self.flush()

        async def begin(run: str) -> None:  # before any output: a retrying client learns if it is a new run
            await emit("execution", {"id": body.id, "run": run})

        try:
            result = await self.service.execute(sid, body.code, body.timeout, on_output=lambda o: emit("output", o),
                                                who=self.who, execution_id=body.id, on_begin=begin)
        except Exception as e:  # headers are sent: the error travels as an event
            await emit("error", {"message": str(e) or type(e).__name__, "code": getattr(e, "code", "internal")})
        else:
            await emit("result", result)
        self.finish()


class ActionHandler(APIHandler):
    async def post(self, sid, action):
        if action == "pause":
            sb = await self.service.pause(sid, self.body(PauseRequest).mode, self.who)
        else:
            self.body(Empty)  # no fields, but malformed JSON is still a 400
            sb = await self.service.resume(sid, self.who)
        self.reply(sandbox_model(sb))


class CheckpointsHandler(APIHandler):
    def get(self, sid):
        self.reply(self.service.checkpoints(sid, self.who))

    async def post(self, sid):
        body = self.body(CheckpointRequest)
        self.service.get(sid, self.who)
        cp = await self.service.checkpoint(sid, body.name, self.who)
        self.reply(cp.summary(), 201)


class CheckpointHandler(APIHandler):
    async def delete(self, sid, cid):
        await self.service.delete_checkpoint(sid, cid, self.who)
        self.set_status(204)
        self.finish()


class EgressHandler(APIHandler):
    """The sandbox's egress policy, changed while it lives: every request the
    proxy checks from now on is decided by the new one."""

    def get(self, sid):
        self.reply(sandbox_model(self.service.get(sid, self.who))["egress"])

    async def patch(self, sid):
        sb = await self.service.set_egress(sid, self.body(EgressPolicy), self.who)
        self.reply(sandbox_model(sb))


class ForkHandler(APIHandler):
    async def post(self, sid):
        body = self.body(ForkRequest)
        sb = await self.service.fork(sid, body.checkpoint, self.who)
        self.set_header("Location", f"/api/sandboxes/{sb.id}")
        self.reply(sandbox_model(sb), 201)


class TreeHandler(APIHandler):
    """Every checkpoint and fork, as nodes and parent links, for drawing."""

    def get(self):
        self.reply(self.service.tree(self.who))


@web.stream_request_body
class FilesHandler(BodyStream, APIHandler):
    """GET a file (a chunk at a time) or a listing; PUT a file as its body arrives."""

    async def prepare(self):
        await super().prepare()
        if self._finished or self.forward_to or self.request.method != "PUT":
            return
        sid, path = self.path_args
        self.stream_to(self.service.upload(sid, path, self.who))

    async def get(self, sid, path):
        try:
            return self.reply(await self.service.list_files(sid, path, self.who))
        except BadRequest as e:
            if e.code != "NotADirectoryError":
                raise
        await self.send_file(self.service.read_file_chunks(sid, path, self.who))

    async def put(self, sid, path):
        if self.forward_to:  # another node's sandbox: the body, gathered, goes there
            self.whole_body()
            return await forward_http(self, self.forward_to)
        self.reply(await self.finish_upload(), 201)

    async def delete(self, sid, path):
        await self.service.delete_file(sid, path, self.who)
        self.set_status(204)
        self.finish()


class OpenAPIHandler(APIHandler):
    def get(self):
        self.reply(openapi())


def openapi() -> dict:
    models = [SandboxCreate, SandboxModel, ExecuteRequest, ExecuteResult, ForkRequest, CheckpointRequest, PauseRequest,
              EgressPolicy, TenantCreate, TenantModel]
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
        return {str(code): r, "4XX": {"description": 'JSON error {"reason", "message", "code"[, "state"]}; another '
                                                          "tenant's id is 404; 429 with Retry-After"},
                "5XX": {"description": 'JSON error {"reason", "message", "code"}: 503 when a runtime failed'}}

    sid = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
    tname = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
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
            "post": {"parameters": sid, "requestBody": body("CheckpointRequest"),
                     "summary": "Checkpoint it; 413 `quota` past the tenant's max_checkpoint_mb", "responses": resp(201)}},
        "/api/sandboxes/{id}/checkpoints/{checkpoint}": {"delete": {
            "parameters": sid + [{"name": "checkpoint", "in": "path", "required": True, "schema": {"type": "string"}}],
            "summary": "Delete a checkpoint and what only it stored; 409 `in_use` naming what still needs it",
            "responses": resp(204, desc="Deleted")}},
        "/api/sandboxes/{id}/fork": {"post": {"parameters": sid, "requestBody": body("ForkRequest"),
                                              "responses": resp(201, "SandboxModel", "Created")}},
        "/api/sandboxes/{id}/egress": {
            "get": {"parameters": sid, "summary": "The egress policy (null: no network)", "responses": resp(200)},
            "patch": {"parameters": sid, "summary": "Replace the egress policy while it runs",
                      "requestBody": body("EgressPolicy"), "responses": resp(200, "SandboxModel")}},
        "/api/sandboxes/{id}/files/{path}": {
            "get": {"parameters": fpath, "summary": "File bytes, or a JSON listing for a directory",
                    "responses": resp(200)},
            "put": {"parameters": fpath, "requestBody": {"content": {"application/octet-stream": {}}},
                    "responses": resp(201)},
            "delete": {"parameters": fpath, "responses": resp(204, desc="Deleted")}},
        "/api/sandboxes/tree": {"get": {"summary": "All checkpoints and sandboxes with parent links",
                                        "responses": resp(200)}},
        "/api/tenants": {
            "get": {"summary": "List tenants (admin only; never their tokens)", "responses": resp(200)},
            "post": {"summary": "Create a tenant (admin only); the answer, a TenantModel plus `token`, is the only "
                                "time the token is shown", "requestBody": body("TenantCreate"),
                     "responses": resp(201, "TenantModel", "Created")}},
        "/api/tenants/{name}": {
            "get": {"parameters": tname, "responses": resp(200, "TenantModel")},
            "delete": {"parameters": tname, "summary": "Delete a tenant and every sandbox it has (admin only)",
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
        (rf"/api/sandboxes/({UUID})/checkpoints/([0-9a-zA-Z_-]+)/?", CheckpointHandler),
        (rf"/api/sandboxes/({UUID})/fork", ForkHandler),
        (rf"/api/sandboxes/({UUID})/egress", EgressHandler),
        (rf"/api/sandboxes/({UUID})/files/?(.*)", FilesHandler),
    ]


"""The E2B-compatible API under /e2b: a thin adapter over SandboxService, so
the unmodified ``e2b`` and ``e2b-code-interpreter`` SDKs work with
``E2B_API_URL`` and ``E2B_SANDBOX_URL`` both set to ``http://HOST:PORT/e2b``
and ``E2B_API_KEY`` a Sandgate token (docs/e2b.md, call by call).

Two kinds of call arrive here:

* the control plane (``/sandboxes``, ``/v2/sandboxes``, ...), authenticated by
  ``X-API-KEY`` (the admin's token or a tenant's);
* sandbox calls, which the SDK sends to ``E2B_SANDBOX_URL`` with the headers
  ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` (49983: envd's files, health and
  Connect RPC filesystem service; 49999: the code interpreter's ``/execute``
  and ``/contexts``). They carry no API key: they are authenticated by the
  access token the create answer handed out (``X-Access-Token`` or
  ``E2B-Traffic-Access-Token``), an HMAC of the sandbox id under the gateway's
  token, which acts as the sandbox's owner and reaches that sandbox only.

Errors leave in E2B's shapes: ``{"code": status, "message"}`` for the control
plane and envd's REST calls, Connect's ``{"code": "not_found", "message"}``
for RPCs. Paths are the sandbox's: relative ones resolve in the kernel's
working directory, /workspace, the only directory the files API reaches.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import logging
import math
import posixpath
import re
import time
from typing import Dict, List, Optional
from urllib.parse import parse_qsl

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tornado import httputil, iostream, web

from ..core.errors import BadRequest, Conflict, Forbidden, NotFound, SandgateError
from ..core.messages import iso, iso_epoch, utcnow
from ..core.service import MAX_LABEL_VALUE, MAX_LABELS, MAX_TTL, StartRequest, check_labels
from ..core.states import State
from ..core.tenants import ADMIN, Principal
from ..logformat import new_request_id
from .base import APIHandler, BodyStream, code_bound, parse_json

log = logging.getLogger("sandgate.e2b")

ENVD_PORT, JUPYTER_PORT = "49983", "49999"
ENVD_VERSION = "0.5.7"  # >= 0.4.0 (no default user), >= 0.5.7 (octet-stream uploads)
CLIENT_ID = "sandgate"
DEFAULT_TEMPLATE = "base"
DEFAULT_TIMEOUT = 300  # seconds: E2B's default sandbox lifetime
TEMPLATE_LABEL = "e2b.template"
WORKSPACE = "/workspace"
DEFAULT_CONTEXT = "python"  # the kernel: one per sandbox
# One ListDir: each directory is one agent request, so both bound how long it takes.
MAX_LIST_DEPTH = 32
MAX_LIST_DIRS = 1000
MAX_LIST_ENTRIES = 20_000
EXECUTE_TIMEOUT = 3600.0  # the SDK bounds a run on its side (run_code timeout, 300 s by default)


class Unsupported(SandgateError):
    """An E2B call or option Sandgate does not have: E2B's error shape, 501."""

    status, code = 501, "unsupported"


# -- E2B request bodies (unknown fields ignored, as E2B ignores them) ------------
class E2BModel(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class NewSandbox(E2BModel):
    templateID: str = Field(DEFAULT_TEMPLATE, max_length=MAX_LABEL_VALUE)  # kept as a label
    timeout: Optional[int] = Field(None, ge=0)
    metadata: Dict[str, str] = {}  # labels, beside the template's own
    envVars: Dict[str, str] = {}
    autoPause: Optional[bool] = None
    allow_internet_access: Optional[bool] = None
    secure: Optional[bool] = None

    _metadata = field_validator("metadata", mode="before")(
        classmethod(lambda cls, v: check_labels(v, "metadata", MAX_LABELS - 1)))


class TimeoutBody(E2BModel):
    timeout: int = Field(ge=0)


class ConnectBody(E2BModel):
    timeout: Optional[int] = Field(None, ge=0)


class RefreshBody(E2BModel):
    duration: Optional[int] = Field(None, ge=0)


class ForkBody(E2BModel):
    timeout: Optional[int] = Field(None, ge=0)
    count: Optional[int] = Field(None, ge=1, le=16)


class SnapshotBody(E2BModel):
    name: Optional[str] = Field(None, max_length=200)


class PauseBody(E2BModel):
    memory: Optional[bool] = None


class ExecuteBody(E2BModel):
    code: str
    context_id: Optional[str] = None
    language: Optional[str] = None
    env_vars: Optional[Dict[str, str]] = None


class ContextBody(E2BModel):
    language: Optional[str] = None
    cwd: Optional[str] = None


class ListDirRequest(E2BModel):
    path: str = ""
    depth: int = 1


class PathRequest(E2BModel):
    path: str = ""


# -- helpers ----------------------------------------------------------------------
def access_token(settings, sandbox_id: str) -> Optional[str]:
    """The sandbox's access token: an HMAC of its id under the gateway's token
    (None when authentication is off)."""
    if not settings.token:
        return None
    return hmac.new(settings.token.encode(), b"e2b-sandbox:" + sandbox_id.encode(), hashlib.sha256).hexdigest()


def e2b_state(sb) -> Optional[str]:
    """E2B knows running and paused; a dead or deleted sandbox is gone (404)."""
    if sb.state in (State.DEAD, State.DELETED):
        return None
    return "paused" if sb.state in (State.PAUSED, State.FROZEN) else "running"


def workspace_path(path: str) -> str:
    """An E2B path as the workspace-relative path the service takes."""
    path = (path or "").strip()
    if path in ("", ".", "~"):
        return ""
    if path.startswith("/"):
        norm = posixpath.normpath(path)
        if norm == WORKSPACE:
            return ""
        if not norm.startswith(WORKSPACE + "/"):
            raise Forbidden(f"{path}: only {WORKSPACE} (the kernel's working directory) is reachable in a Sandgate "
                            f"sandbox; use a relative path or one under {WORKSPACE}")
        return norm[len(WORKSPACE) + 1:]
    return path


def sandbox_path(rel: str) -> str:
    return posixpath.join(WORKSPACE, rel) if rel else WORKSPACE


def template_of(sb) -> str:
    return sb.record.labels.get(TEMPLATE_LABEL, DEFAULT_TEMPLATE)


E2B_KEY = re.compile(r"e2b_((?:[0-9a-f]{2})+)")


def e2b_api_key(token: str) -> str:
    """A Sandgate token in the shape some e2b SDK versions insist on (``e2b_`` and hex digits): its
    bytes, hex-encoded. ``sandgate e2b-key`` prints it; the adapter takes either form."""
    return "e2b_" + token.encode().hex()


def token_of_key(key: str) -> str:
    """The Sandgate token an ``X-API-KEY`` carries, plain or as ``e2b_api_key`` made it."""
    m = E2B_KEY.fullmatch(key)
    if m:
        try:
            return bytes.fromhex(m.group(1)).decode()
        except UnicodeDecodeError:
            pass
    return key


class E2BHandler(APIHandler):
    """E2B's control plane: ``X-API-KEY`` (or Sandgate's own ``Authorization``)."""

    async def prepare(self):
        self.set_header("X-Request-Id", new_request_id(self.request.headers.get("X-Request-Id")))
        self.set_cors()
        if self.request.method == "OPTIONS":
            return
        key = token_of_key(self.request.headers.get("X-API-KEY", ""))
        self.who = await (self.principal(key) if key else self.authenticate())
        if self.who is None:
            raise E2BError(401, "Invalid API key: not a Sandgate token (the admin's or a tenant's)")

    def e2b_body(self, model):
        data = parse_json(self.request.body or b"{}") if self.request.body else {}
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise BadRequest("The body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise BadRequest("; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
                                       for err in e.errors())) from None

    def sandbox_json(self, sb, detail: bool = False) -> dict:
        r = sb.record
        tok = access_token(self.settings["sandgate"], sb.id)
        body = {"templateID": template_of(sb), "sandboxID": sb.id, "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
                "alias": template_of(sb), "domain": None}
        if tok:
            body["envdAccessToken"] = body["trafficAccessToken"] = tok
        if detail:
            body.update({
                "startedAt": iso_epoch(r.created),
                "endAt": iso_epoch(r.expires or r.created + MAX_TTL),
                "cpuCount": max(1, math.ceil(r.limits.cpus)), "memoryMB": r.limits.memory_mb,
                "diskSizeMB": r.limits.disk_mb, "state": e2b_state(sb),
                "metadata": {k: v for k, v in r.labels.items() if k != TEMPLATE_LABEL},
            })
        return body

    def lifetime(self, asked: Optional[int]) -> float:
        """Seconds a sandbox lives: what was asked (above SANDGATE_MAX_TTL a 400), else E2B's default
        within that ceiling."""
        if asked:
            return asked
        ceiling = self.service.settings.max_ttl
        return min(DEFAULT_TIMEOUT, ceiling) if ceiling else DEFAULT_TIMEOUT

    def live(self, sid: str):
        sb = self.service.get(sid, self.who)
        if e2b_state(sb) is None:
            why = f"{sb.state.value}: {sb.record.reason}" if sb.record.reason else sb.state.value
            raise NotFound(f"Sandbox {sid} not found ({why})")
        return sb

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, SandgateError):
            message = exc.message
        elif isinstance(exc, web.HTTPError):
            message = exc.log_message % exc.args if exc.log_message and exc.args else (exc.log_message or self._reason)
        elif exc is not None:
            message = f"{type(exc).__name__}: {exc}"
        else:
            message = self._reason
        if getattr(exc, "retry_after", None) is not None:
            self.set_header("Retry-After", str(max(1, math.ceil(exc.retry_after))))
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"code": status_code, "message": message}))


class E2BError(SandgateError):
    """An answer with a status of its own (401: a key or sandbox token that is not one)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# -- control plane ------------------------------------------------------------------
class SandboxesHandler(E2BHandler):
    """POST /sandboxes and /v2/sandboxes: create; GET: list (v1 and v2)."""

    async def post(self):
        body = self.e2b_body(NewSandbox)
        if body.autoPause:
            raise Unsupported("autoPause is not supported: a Sandgate sandbox is deleted at its timeout "
                              "(pause it with POST /sandboxes/{id}/pause)")
        if body.allow_internet_access:
            # Some SDK versions send true unless told otherwise: refusing it would refuse every create.
            log.info("e2b create: allow_internet_access ignored: the sandbox's network is its egress policy "
                     "(docs/egress.md); it has none")
        allowed = set(self.service.settings.env_allow)
        refused = sorted(k for k in body.envVars if not (k.startswith("KERNEL_") or k in allowed))
        if refused:
            raise BadRequest(f"envVars {', '.join(refused)}: only KERNEL_* and the names in SANDGATE_ENV_ALLOW reach "
                             "a Sandgate sandbox")
        labels = {**body.metadata, TEMPLATE_LABEL: body.templateID}
        req = {"env": body.envVars, "labels": labels, "ttl": self.lifetime(body.timeout)}
        template = body.templateID
        if template in self.service.driver_names():
            req["driver"] = template  # a template named after a driver picks it: "gvisor", "qemu"
        elif template not in (DEFAULT_TEMPLATE, "code-interpreter-v1", "code-interpreter", "base-v1"):
            cp = self.snapshot(template)
            if cp is None:
                raise NotFound(f"template '{template}' not found: Sandgate knows 'base', 'code-interpreter-v1', "
                               f"a driver name ({', '.join(self.service.driver_names())}) or a snapshot id")
            req["checkpoint"] = cp.id
        sb = await self.service.start(StartRequest(**req), self.who)
        self.reply(self.sandbox_json(sb), 201)

    def snapshot(self, cid: str):
        try:
            return self.service.checkpoint_get(cid, self.who)
        except NotFound:
            return None

    def get(self):
        want = {s for s in self.get_query_argument("state", "").split(",") if s}
        meta = dict(parse_qsl(self.get_query_argument("metadata", "")))
        out = []
        for sb in self.service.list(self.who):
            state = e2b_state(sb)
            if state is None or (want and state not in want):
                continue
            if any(sb.record.labels.get(k) != v for k, v in meta.items()):
                continue
            out.append(self.sandbox_json(sb, detail=True))
        out.sort(key=lambda s: s["startedAt"], reverse=self.get_query_argument("order", "") == "desc")
        for s in out:
            s.pop("envdAccessToken", None)
            s.pop("trafficAccessToken", None)
        self.reply(out)


class SandboxHandler(E2BHandler):
    def get(self, sid):
        self.reply(self.sandbox_json(self.live(sid), detail=True))

    async def delete(self, sid):
        await self.service.delete(sid, self.who)
        self.set_status(204)
        self.finish()


class TimeoutHandler(E2BHandler):
    async def post(self, sid):
        body = self.e2b_body(TimeoutBody)
        self.live(sid)
        await self.service.set_timeout(sid, max(1, body.timeout), self.who)
        self.set_status(204)
        self.finish()


class RefreshHandler(E2BHandler):
    async def post(self, sid):
        body = self.e2b_body(RefreshBody)
        sb = self.live(sid)
        left = (sb.record.expires or time.time()) - time.time()
        await self.service.set_timeout(sid, max(left, self.lifetime(body.duration), 1), self.who)
        self.set_status(204)
        self.finish()


class PauseHandler(E2BHandler):
    async def post(self, sid):
        self.e2b_body(PauseBody)  # validated; its memory flag: below
        sb = self.live(sid)
        if e2b_state(sb) == "paused":
            raise Conflict(f"Sandbox {sid} is already paused")
        # E2B's memory=true is a full snapshot, false the filesystem only; Sandgate's pause to disk keeps both
        # (the kernel's memory too), so either way it is that. (Sandgate's "memory" mode, frozen in place and
        # saved nowhere, is not what E2B means.)
        await self.service.pause(sid, "disk", self.who)
        self.set_status(204)
        self.finish()


class ConnectHandler(E2BHandler):
    """POST /sandboxes/{id}/connect, /v2/sandboxes/{id}/connect and /resume:
    resume a paused sandbox (201) or connect to a running one (200)."""

    async def post(self, sid, *_):
        body = self.e2b_body(ConnectBody)
        sb = self.live(sid)
        resumed = e2b_state(sb) == "paused"
        if resumed:
            sb = await self.service.resume(sid, self.who)
        if body.timeout:
            await self.service.set_timeout(sid, body.timeout, self.who)
        self.reply(self.sandbox_json(sb), 201 if resumed else 200)


class ForkHandler(E2BHandler):
    async def post(self, sid):
        body = self.e2b_body(ForkBody)
        self.live(sid)
        results = []
        for _ in range(body.count or 1):
            try:
                child = await self.service.fork(sid, None, self.who)
                try:
                    await self.service.set_timeout(child.id, self.lifetime(body.timeout), self.who)
                except SandgateError:
                    await self.service.delete(child.id, self.who)  # a fork without its timeout is not left behind
                    raise
                results.append({"sandbox": self.sandbox_json(child)})
            except SandgateError as e:
                results.append({"error": {"code": e.status, "message": e.message}})
        self.reply(results, 201)


class SnapshotsHandler(E2BHandler):
    async def post(self, sid):
        body = self.e2b_body(SnapshotBody)
        self.live(sid)
        cp = await self.service.checkpoint(sid, body.name or "", self.who)
        self.reply({"snapshotID": cp.id, "names": [body.name] if body.name else []}, 201)


class UnsupportedHandler(E2BHandler):
    """Every other E2B call: its JSON error shape, saying what is not here."""

    def _no(self, *args):
        raise Unsupported(f"{self.request.method} {self.request.path}: this E2B call is not supported by Sandgate's "
                          "E2B adapter (docs/e2b.md lists what is)")

    get = post = put = patch = delete = _no


# -- sandbox calls (E2b-Sandbox-Id / E2b-Sandbox-Port) -------------------------------------
class SandboxCallHandler(E2BHandler):
    """A call the SDK sends to E2B_SANDBOX_URL; ``port`` is the service it is for."""

    port = ENVD_PORT

    async def prepare(self):
        self.set_header("X-Request-Id", new_request_id(self.request.headers.get("X-Request-Id")))
        self.set_cors()
        self.sid = self.request.headers.get("E2b-Sandbox-Id", "")
        port = self.request.headers.get("E2b-Sandbox-Port", "")
        if not self.sid or not port:
            raise NotFound(f"{self.request.path}: a sandbox call needs the headers E2b-Sandbox-Id and E2b-Sandbox-Port "
                           "(set E2B_SANDBOX_URL to this gateway's /e2b)")
        if port != self.port:
            raise NotFound(f"{self.request.path} is not served on port {port} of a Sandgate sandbox "
                           f"({ENVD_PORT}: envd, {JUPYTER_PORT}: code interpreter)")
        given = self.request.headers.get("X-Access-Token") or self.request.headers.get("E2B-Traffic-Access-Token")
        expected = access_token(self.settings["sandgate"], self.sid)
        if expected is None:
            self.who = ADMIN
        elif given and hmac.compare_digest(given.encode(), expected.encode()):
            sb = self.service.get(self.sid)  # the token is this sandbox's: its owner calls
            self.who = Principal(sb.record.owner or None)
        else:
            key = token_of_key(self.request.headers.get("X-API-KEY", ""))
            self.who = await (self.principal(key) if key else self.authenticate())
            if self.who is None:
                raise E2BError(401, "Invalid access token for this sandbox")
        self.live(self.sid)


class HealthHandler(SandboxCallHandler):
    def get(self):
        self.set_status(204)
        self.finish()


@web.stream_request_body
class FilesHandler(BodyStream, SandboxCallHandler):
    """envd's GET /files (read, a chunk at a time) and POST /files (write: octet-stream, gzip or
    not, streamed to the sandbox as it arrives; multipart gathered, then written)."""

    async def prepare(self):
        await super().prepare()
        if self._finished or self.request.method != "POST":
            return
        if self.request.headers.get("Content-Type", "").startswith("multipart/form-data"):
            self.gather_body()
            return
        path = self.get_query_argument("path", None)
        if not path:
            raise BadRequest("an octet-stream upload needs ?path=")
        self.rel = workspace_path(path)
        gzip = self.request.headers.get("Content-Encoding", "").lower() == "gzip"  # files.write(gzip=True)
        self.stream_to(self.service.upload(self.sid, self.rel, self.who), gzip=gzip)

    async def get(self):
        rel = workspace_path(self.get_query_argument("path", ""))
        await self.send_file(self.service.read_file_chunks(self.sid, rel, self.who))

    async def post(self):
        if self.gathered is None:
            await self.finish_upload()
            return self.reply([{"name": posixpath.basename(self.rel), "type": "file", "path": sandbox_path(self.rel)}])
        body = self.whole_body()
        args: dict = {}
        files: dict = {}
        httputil.parse_body_arguments(self.request.headers.get("Content-Type", ""), body, args, files,
                                      self.request.headers)
        del body
        self.request.body = b""  # the parts hold the files now
        parts = [f for fs in files.values() for f in fs]
        if not parts:
            raise BadRequest("multipart upload without a file part")
        path = self.get_query_argument("path", None)
        uploads = [(path if path and len(parts) == 1 else f.filename, f.body) for f in parts]
        out = []
        for p, data in uploads:
            rel = workspace_path(p)
            await self.service.write_file(self.sid, rel, data, self.who)
            out.append({"name": posixpath.basename(rel), "type": "file", "path": sandbox_path(rel)})
        self.reply(out)


# -- envd's Connect RPC filesystem service (JSON codec) ----------------------------------------
CONNECT_CODES = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
                 409: "failed_precondition", 429: "resource_exhausted", 501: "unimplemented", 503: "unavailable"}


def rfc3339(mtime: float) -> str:
    # A cell sets any mtime it likes (os.utime): one outside datetime's years is shown at its bound.
    try:
        t = dt.datetime.fromtimestamp(mtime, dt.timezone.utc)
    except (OverflowError, ValueError, OSError):
        t = dt.datetime.max if mtime > 0 else dt.datetime.min
    return f"{t.year:04d}" + t.strftime("-%m-%dT%H:%M:%S.%fZ")


def entry_json(rel_dir: str, e: dict) -> dict:
    rel = posixpath.join(rel_dir, e["name"]) if rel_dir else e["name"]
    kind = {"directory": "FILE_TYPE_DIRECTORY", "file": "FILE_TYPE_FILE"}.get(e["type"], "FILE_TYPE_FILE")
    return {"name": e["name"], "type": kind, "path": sandbox_path(rel), "size": str(e.get("size", 0)),
            "isSymlink": e["type"] == "symlink", "modifiedTime": rfc3339(e.get("mtime", 0))}


class RPCHandler(SandboxCallHandler):
    """POST /filesystem.Filesystem/{Method}: ListDir, Stat, Remove; the rest
    (and the process service) answer Connect's ``unimplemented``."""

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = exc.message if isinstance(exc, SandgateError) else (str(exc) if exc else self._reason)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"code": CONNECT_CODES.get(status_code, "internal" if status_code >= 500 else "unknown"),
                                "message": message}))

    async def post(self, service, method):
        if service != "filesystem.Filesystem" or method not in ("ListDir", "Stat", "Remove"):
            raise Unsupported(f"{service}/{method} is not supported by Sandgate's E2B adapter: files.list, exists, "
                              "get_info, remove, read and write are; commands, pty, make_dir, rename and watch are not")
        if method == "ListDir":
            req = self.e2b_body(ListDirRequest)
            if req.depth > MAX_LIST_DEPTH:
                raise BadRequest(f"ListDir depth {req.depth} is above Sandgate's limit of {MAX_LIST_DEPTH}: list a "
                                 "subdirectory for what is deeper")
            rel = workspace_path(req.path)
            entries = await self.list_tree(rel, max(1, req.depth or 1))
            return self.reply({"entries": entries})
        req = self.e2b_body(PathRequest)
        rel = workspace_path(req.path)
        if method == "Remove":
            await self.service.delete_file(self.sid, rel, self.who)
            return self.reply({})
        # Stat: the entry as its directory lists it
        if not rel:
            return self.reply({"entry": {"name": "workspace", "type": "FILE_TYPE_DIRECTORY", "path": WORKSPACE}})
        parent, name = posixpath.split(rel.rstrip("/"))
        listing = await self.service.list_files(self.sid, parent, self.who)
        for e in listing["entries"]:
            if e["name"] == name:
                return self.reply({"entry": entry_json(parent, e)})
        raise NotFound(f"No such file: {sandbox_path(rel)}")

    async def list_tree(self, rel: str, depth: int) -> List[dict]:
        """Entries to ``depth`` levels, each directory's right after it (as envd lists them). Iterative and
        bounded: one agent request per directory, at most MAX_LIST_DIRS of them (a deep or wide tree is a
        400 saying so, not minutes of requests and a RecursionError)."""
        out: List[dict] = []
        todo = [(rel, depth, 0)]  # (directory, levels left, where its entries go in out)
        listed = 0
        while todo:
            d, left, at = todo.pop()
            listed += 1
            mine, subdirs = [], []
            for e in (await self.service.list_files(self.sid, d, self.who))["entries"]:
                mine.append(entry_json(d, e))
                if e["type"] == "directory" and left > 1:
                    subdirs.append((posixpath.join(d, e["name"]) if d else e["name"], len(mine)))
            out[at:at] = mine
            if len(out) > MAX_LIST_ENTRIES:
                raise BadRequest(f"ListDir of {sandbox_path(rel)} at depth {depth} has more than {MAX_LIST_ENTRIES} "
                                 "entries, Sandgate's limit for one listing: ask a smaller depth or a subdirectory")
            # Each subdirectory's entries go right after it; the last is listed first, so the
            # positions of those before it stay where they are.
            todo.extend((sub, left - 1, at + pos) for sub, pos in subdirs)
            if listed + len(todo) > MAX_LIST_DIRS:  # known as soon as they are seen, not 1000 requests later
                raise BadRequest(f"ListDir of {sandbox_path(rel)} at depth {depth} reaches more than {MAX_LIST_DIRS} "
                                 "directories, Sandgate's limit for one listing: ask a smaller depth or a subdirectory")
        return out


# -- the code interpreter (port 49999) ------------------------------------------------------
MIME_FIELDS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
               "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
               "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
               "e2b/chart": "chart"}


def result_json(out: dict) -> dict:
    """A Jupyter execute_result/display_data as an E2B result: each MIME type in its field, others in extra."""
    res = {"type": "result", "is_main_result": out["type"] == "execute_result"}
    extra = {}
    for mime, value in (out.get("data") or {}).items():
        field = MIME_FIELDS.get(mime)
        if field:
            res[field] = value
        else:
            extra[mime] = value
    if extra:
        res["extra"] = extra
    return res


def ndjson_of(out: dict) -> Optional[dict]:
    if out["type"] == "stream":
        return {"type": "stdout" if out.get("name") == "stdout" else "stderr", "text": out.get("text", ""),
                "timestamp": iso(utcnow())}
    if out["type"] in ("execute_result", "display_data"):
        return result_json(out)
    if out["type"] == "error":
        return {"type": "error", "name": out.get("ename") or "Error", "value": out.get("evalue") or "",
                "traceback": "\n".join(out.get("traceback") or [])}
    return None


class InterpreterHandler(SandboxCallHandler):
    port = JUPYTER_PORT

    def context(self) -> dict:
        return {"id": DEFAULT_CONTEXT, "language": "python", "cwd": WORKSPACE}

    def check_context(self, cid: Optional[str]) -> None:
        if cid not in (None, DEFAULT_CONTEXT):
            raise NotFound(f"context {cid} not found: a Sandgate sandbox has one context, '{DEFAULT_CONTEXT}' "
                           "(its kernel); fork the sandbox for a second one")


class ExecuteHandler(InterpreterHandler):
    """POST /execute: NDJSON lines as the kernel produces them, then the execution count and the end."""

    max_body = staticmethod(code_bound)

    async def post(self):
        body = self.e2b_body(ExecuteBody)
        self.request.body = b""  # parsed: the code is held once from here on, not twice
        self.check_context(body.context_id)
        if body.language not in (None, "python", "python3"):
            raise BadRequest(f"language {body.language!r}: a Sandgate sandbox runs Python only")
        if body.env_vars:
            raise Unsupported("env_vars on run_code is not supported: set them in the code (os.environ)")
        self.set_header("Content-Type", "application/x-ndjson")
        stream = getattr(self.request.connection, "stream", None)
        if stream is not None:
            stream.set_nodelay(True)  # each line leaves as it is written, as the kernel websocket's frames do

        async def emit(line: dict, flush: bool = True) -> None:
            self.write(json.dumps(line) + "\n")
            if flush:
                await self.flush()

        async def on_output(out: dict) -> None:
            line = ndjson_of(out)
            if line:
                await emit(line)

        try:
            result = await self.service.execute(self.sid, body.code, EXECUTE_TIMEOUT, on_output=on_output, who=self.who)
        except iostream.StreamClosedError:
            return
        except SandgateError as e:  # the answer has begun: the failure is an error line
            await emit({"type": "error", "name": type(e).__name__, "value": e.message, "traceback": ""})
            result = {"execution_count": None}
        error = result.get("error")
        if error and error not in result.get("outputs", []):  # in the reply only: Aborted, DeadKernelError
            await emit(ndjson_of(error))
        if result.get("status") == "timeout":
            await emit({"type": "error", "name": "TimeoutError", "value": f"the cell ran past {EXECUTE_TIMEOUT:.0f} s "
                        "and was interrupted", "traceback": ""})
        if result.get("execution_count") is not None:
            await emit({"type": "number_of_executions", "execution_count": result["execution_count"]}, flush=False)
        await emit({"type": "end_of_execution"}, flush=False)
        self.finish()  # the last lines and the end of the chunked answer in one write


class ContextsHandler(InterpreterHandler):
    def get(self):
        self.reply([self.context()])

    def post(self):
        body = self.e2b_body(ContextBody)
        raise Unsupported("a Sandgate sandbox has one code context, its kernel ('python', cwd /workspace); "
                          f"{'a ' + body.language + ' ' if body.language else 'a second '}context cannot be created: "
                          "fork the sandbox (Sandbox.fork) for independent state")


class ContextHandler(InterpreterHandler):
    async def post(self, cid, action=None):
        self.check_context(cid)
        if action != "restart":
            raise Unsupported(f"POST /contexts/{cid}: only /contexts/{cid}/restart is an E2B call")
        await self.service.restart(self.sid, self.who)
        self.reply({})

    def delete(self, cid, action=None):
        self.check_context(cid)
        raise Unsupported("the default context is the sandbox's kernel and cannot be removed; kill the sandbox")


def routes(prefix: str = "/e2b") -> list:
    sid = r"([^/]+)"
    return [
        # control plane
        (rf"{prefix}(?:/v2)?/sandboxes/?", SandboxesHandler),
        (rf"{prefix}/sandboxes/{sid}", SandboxHandler),
        (rf"{prefix}/sandboxes/{sid}/timeout", TimeoutHandler),
        (rf"{prefix}/sandboxes/{sid}/refreshes", RefreshHandler),
        (rf"{prefix}/sandboxes/{sid}/pause", PauseHandler),
        (rf"{prefix}(?:/v2)?/sandboxes/{sid}/(connect|resume)", ConnectHandler),
        (rf"{prefix}/sandboxes/{sid}/fork", ForkHandler),
        (rf"{prefix}/sandboxes/{sid}/snapshots", SnapshotsHandler),
        # sandbox calls: envd (49983)
        (rf"{prefix}/health", HealthHandler),
        (rf"{prefix}/files", FilesHandler),
        (rf"{prefix}/(filesystem\.Filesystem|process\.Process)/(\w+)", RPCHandler),
        # sandbox calls: the code interpreter (49999)
        (rf"{prefix}/execute", ExecuteHandler),
        (rf"{prefix}/contexts/?", ContextsHandler),
        (rf"{prefix}/contexts/([^/]+)/?(restart)?", ContextHandler),
        (rf"{prefix}/.*", UnsupportedHandler),
    ]

"""What every handler shares: token auth (who the caller is), CORS, JSON
bodies and JSON errors (the one place core errors become HTTP)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import re
import zlib
from typing import Optional, Type, TypeVar

from pydantic import BaseModel, ValidationError
from tornado import iostream, web

from ..core.errors import BadRequest, SandgateError, TooLarge
from ..core.fleetauth import AUTH as FLEET_AUTH, FleetAuthError
from ..core.tenants import ADMIN, Principal
from ..logformat import new_request_id
from .forward import FORWARDED, forward_http, gather

log = logging.getLogger("sandgate.api")
SANDBOX_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
M = TypeVar("M", bound=BaseModel)


class AuthMixin:
    """Token in ``Authorization: token T`` (or ``Bearer T``) or ``?token=T``:
    the serve token is the admin, a tenant's token that tenant."""

    who: Optional[Principal] = None  # the caller, once authenticated; handlers pass it to the service
    forwarded = False  # a request another node of the fleet forwarded here, signed: answered here
    signed_body: Optional[str] = None  # a forwarded body still arriving: the SHA-256 it was signed with

    async def authenticate(self) -> Optional[Principal]:
        """The caller, or None (401)."""
        if FLEET_AUTH in self.request.headers:
            return await self.fleet_principal()
        auth = self.request.headers.get("Authorization", "")
        scheme, _, value = auth.partition(" ")
        given = value.strip() if scheme.lower() in ("token", "bearer") else self.get_query_argument("token", "")
        return await self.principal(given)

    async def fleet_principal(self) -> Optional[Principal]:
        """The caller another node vouches for, with the fleet key (core/fleetauth.py); None (401)
        if the signature does not verify or this gateway is not in a fleet."""
        fleet = self.settings.get("fleet")
        if fleet is None:
            return None
        streamed = getattr(self, "streams_body", False) and self.request.method in ("POST", "PUT", "PATCH")
        try:
            # A body taken as it arrives is not here yet: the signature is checked now with the hash it
            # declares, and BodyStream checks the body against that hash before its end is acted on.
            who, sender = fleet.auth.verify(self.request.method, self.request.uri,
                                            None if streamed else (self.request.body or b""), self.request.headers)
            if streamed:
                self.signed_body = fleet.auth.body_digest(self.request.headers)
        except FleetAuthError as e:
            log.warning("%s %s: refused a forwarded request: %s", self.request.method, self.request.path, e)
            return None
        if not who.admin and not await self.settings["service"].tenant_exists(who.tenant):
            return None  # deleted since the other node checked its token
        self.forwarded = True
        return who

    async def principal(self, given: str) -> Optional[Principal]:
        """Who the token ``given`` is: the admin, a tenant, or None (401)."""
        token = self.settings["sandgate"].token
        if token and given and hmac.compare_digest(given.encode(), token.encode()):
            return ADMIN
        if given:
            tenant = await self.settings["service"].tenants.authenticate(given)
            if tenant:
                return tenant
        return None if token else ADMIN  # no serve token: authentication is off, every caller is the admin

    async def remote_node(self):
        """The fleet node (core.fleet.Peer) holding the sandbox this request names
        (its first path argument), if that is another node; None otherwise."""
        fleet = self.settings.get("fleet")
        if fleet is None or not self.path_args or self.forwarded or FORWARDED in self.request.headers:
            return None
        sid = self.path_args[0]
        if not SANDBOX_ID.fullmatch(sid or ""):
            return None
        try:
            return await fleet.locate(sid, self.who)
        except SandgateError as e:
            raise web.HTTPError(e.status, "%s", e.message) from None

    def on_finish(self) -> None:
        release = getattr(self.request, "release_budget", None)  # its body (api/admission.py)
        if release:
            release()

    def hold(self, n: int):
        """``n`` bytes written to the client and not yet flushed, on the gateway's client budget until
        they are: returns the callback that gives them back."""
        budget = self.settings["budget"]
        budget.take(n)
        return lambda *_: budget.give(n)

    async def send(self, data: bytes) -> None:
        """Write and flush, counted on the budget meanwhile: awaiting the flush is the backpressure
        (a client that does not read holds one chunk here, not the whole answer)."""
        give = self.hold(len(data))
        try:
            self.write(data)
            del data
            await self.flush()
        finally:
            give()

    async def send_file(self, chunks) -> None:
        """A file from ``service.read_file_chunks``, a chunk at a time, each flushed before the next is
        read. A failure after the first chunk cannot be a status any more: the connection is cut short
        of its Content-Length, so the client sees an incomplete answer, not a wrong file."""
        started = False
        try:
            async for total, data in chunks:
                if not started:
                    self.set_header("Content-Type", "application/octet-stream")
                    self.set_header("Content-Length", str(total))
                    started = True
                await self.send(data)
        except iostream.StreamClosedError:
            return  # the client went
        except SandgateError as e:
            if not started:
                raise
            log.warning("%s %s: cut short: %s", self.request.method, self.request.path, e)
            self.request.connection.close()
            return
        self.finish()

    def set_cors(self) -> None:
        allow = self.settings["sandgate"].allow_origin
        origin = self.request.headers.get("Origin")
        if allow == "*":
            self.set_header("Access-Control-Allow-Origin", "*")
        elif allow and origin == allow:
            self.set_header("Access-Control-Allow-Origin", origin)
            self.set_header("Vary", "Origin")


class APIHandler(AuthMixin, web.RequestHandler):
    streams_body = False  # a BodyStream: its body arrives after prepare, through data_received
    forward_to = None  # the fleet Peer a streamed body goes to, once read

    async def prepare(self):
        self.set_header("X-Request-Id", new_request_id(self.request.headers.get("X-Request-Id")))
        self.set_cors()
        if self.request.method == "OPTIONS":
            return
        self.who = await self.authenticate()
        if self.who is None:
            raise web.HTTPError(401)
        peer = await self.remote_node()
        if peer and self.streams_body and self.request.method in ("POST", "PUT", "PATCH"):
            self.forward_to = peer  # its body is not read yet: forwarded once it is (BodyStream)
        elif peer:  # the sandbox lives on another node: its answer is this one's
            await forward_http(self, peer)

    def fleet_wide(self):
        """The fleet, when this request is to be answered for the whole of it
        (not when another node forwarded it here)."""
        fleet = self.settings.get("fleet")
        return None if fleet is None or self.forwarded or FORWARDED in self.request.headers else fleet

    async def reply_list(self, local: list) -> None:
        """A list of sandboxes or kernels: this node's, and every other live node's."""
        fleet = self.fleet_wide()
        others = await gather(self, await fleet.others()) if fleet else []
        self.reply(local + others)

    async def placed_elsewhere(self) -> bool:
        """A create that another node, with more free capacity, answers."""
        fleet = self.fleet_wide()
        body = parse_json(self.request.body or b"{}")
        if isinstance(body, dict) and body.get("checkpoint"):
            return False  # a start from a checkpoint stays with the checkpoints, in this node's home
        peer = await fleet.place() if fleet else None
        if peer:
            await forward_http(self, peer)
        return bool(peer)

    @property
    def service(self):
        return self.settings["service"]

    def set_default_headers(self):
        self.set_header("Content-Type", "application/json")

    def options(self, *args, **kwargs):
        # Preflight carries no token by design (browsers cannot add one).
        if self.settings["sandgate"].allow_origin:
            self.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type, X-XSRFToken")
            self.set_header("Access-Control-Allow-Methods", "GET, POST, PUT, PATCH, DELETE, OPTIONS")
            self.set_header("Access-Control-Max-Age", "600")
        self.set_status(204)
        self.finish()

    def body(self, model: Type[M]) -> M:
        """The request body validated against ``model``; 400 otherwise."""
        data = parse_json(self.request.body or b"{}")
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise web.HTTPError(400, "The body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
            raise web.HTTPError(400, "%s", problems) from None

    def reply(self, data, status: int = 200) -> None:
        self.set_status(status)
        body = json.dumps(data).encode()
        self.finish(body).add_done_callback(self.hold(len(body)))  # held until flushed

    def _handle_request_exception(self, e: BaseException) -> None:
        # The core's errors are answers, not crashes: one status per class, no traceback.
        if isinstance(e, SandgateError) and not self._finished:
            if e.status >= 500:
                log.warning("%s %s: %d %s", self.request.method, self.request.path, e.status, e)
            self.send_error(e.status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = ""
        if isinstance(exc, SandgateError):
            body = {"reason": self._reason, "message": exc.message, "code": exc.code}
            if getattr(exc, "retry_after", None) is not None:  # RateLimited (429)
                self.set_header("Retry-After", str(max(1, math.ceil(exc.retry_after))))
                body["retry_after"] = round(exc.retry_after, 3)
            if getattr(exc, "state", None):
                body["state"] = exc.state
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(body))
            return
        if isinstance(exc, web.HTTPError):
            message = exc.log_message % exc.args if exc.log_message and exc.args else (exc.log_message or "")
        elif exc is not None:
            # Logged with its traceback by tornado; the client gets one line.
            message = f"{type(exc).__name__}: {exc}"
        reason = self._reason
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"reason": reason, "message": message}))

    def log_exception(self, typ, value, tb):
        if isinstance(value, web.HTTPError):
            if value.status_code >= 500 or value.status_code == 403:
                message = value.log_message % value.args if value.log_message and value.args else value.log_message
                log.warning("%s %s: %d %s", self.request.method, self.request.path, value.status_code, message or "")
            return
        super().log_exception(typ, value, tb)


def code_bound(settings) -> tuple:
    """The body bound of an execute call (api/admission.py): its code, JSON-escaped."""
    return min(settings.max_code_mb, settings.max_message_mb) << 20, "SANDGATE_MAX_CODE_MB"


def parse_json(raw: bytes):
    """JSON, or a 400: malformed, or nested too deep for the parser (RecursionError)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise web.HTTPError(400, "Invalid JSON in body of request") from None


def not_found(message: str) -> web.HTTPError:
    return web.HTTPError(404, "%s", message)


def error(status: int, message: str) -> web.HTTPError:
    return web.HTTPError(status, "%s", message)


UPLOAD_CHUNK = 1 << 20  # an upload reaches the agent this much at a time
INFLATE_STEP = 1 << 20


class BodyStream:
    """A file upload taken as it arrives (tornado's stream_request_body): each UPLOAD_CHUNK goes
    to the agent (core/service.py's Upload) and is answered before tornado reads more from the
    client, so an upload holds one chunk in the gateway, not the file. A gzip body is inflated a
    step at a time on the way, bounded by SANDGATE_MAX_MESSAGE_MB. A body wanted whole (multipart,
    a sandbox on another node) is gathered instead, bounded by the same and counted on the
    client budget. data_received never raises (tornado would drop the connection unanswered):
    a failure is kept, the rest of the body read and dropped, and the method raises it."""

    streams_body = True
    holds_at_most = 2 * UPLOAD_CHUNK  # what api/admission.py counts of its body on the client budget

    upload = None
    failed: Optional[BaseException] = None
    inflater = None
    gathered: Optional[list] = None
    gathered_bytes = 0
    received = 0
    body_hash = None  # of a forwarded body, as it arrives (signed_body)

    def check_signed_body(self) -> None:
        """A forwarded body must be the one its node signed (AuthMixin.fleet_principal)."""
        if self.signed_body is None:
            return
        got = (self.body_hash or hashlib.sha256()).hexdigest()
        if not hmac.compare_digest(got, self.signed_body):
            log.warning("%s %s: refused a forwarded request: its body is not the one signed",
                        self.request.method, self.request.path)
            raise web.HTTPError(401)

    def stream_to(self, upload, gzip: bool = False) -> None:
        self.upload, self.pending = upload, bytearray()
        if gzip:
            self.inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            self.inflated = 0

    def gather_body(self) -> None:
        self.gathered = []

    async def data_received(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.signed_body is not None:
            if self.body_hash is None:
                self.body_hash = hashlib.sha256()
            self.body_hash.update(chunk)
        if self.failed is not None:
            return
        if self.gathered is not None or self.forward_to:
            if self.gathered is None:
                self.gathered = []
            self.gathered.append(chunk)
            self.gathered_bytes += len(chunk)
            self.settings["budget"].take(len(chunk))
            return
        if self.upload is None:
            return
        try:
            if self.inflater is not None:
                await self._inflate(chunk)
            else:
                self.pending += chunk
            await self._send_full_chunks()
        except Exception as e:  # kept for the method to answer
            self.failed = e
            await self.upload.abort()

    async def _inflate(self, data: bytes) -> None:
        limit = self.settings["sandgate"].max_message_mb << 20
        while data:
            if self.inflater.eof:  # another gzip member follows, as gzip.decompress reads them
                self.inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                out = self.inflater.decompress(data, INFLATE_STEP)
            except zlib.error as e:
                raise BadRequest(f"Content-Encoding gzip, but the body is not gzip: {e}") from None
            self.inflated += len(out)
            if self.inflated > limit:
                raise TooLarge(f"the gzip body inflates past {limit >> 20} MiB, the most a file upload may be "
                               "(SANDGATE_MAX_MESSAGE_MB)")
            self.pending += out
            data = self.inflater.unused_data if self.inflater.eof else self.inflater.unconsumed_tail
            await self._send_full_chunks()

    async def _send_full_chunks(self) -> None:
        while len(self.pending) >= UPLOAD_CHUNK:
            chunk = bytes(self.pending[:UPLOAD_CHUNK])
            del self.pending[:UPLOAD_CHUNK]
            await self.upload.write(chunk)

    async def finish_upload(self) -> dict:
        """The body is in: the last chunk, and the file's answer (or the failure kept meanwhile)."""
        if self.failed is not None:
            raise self.failed
        try:
            self.check_signed_body()
            if self.inflater is not None and self.received and not self.inflater.eof:
                raise BadRequest("Content-Encoding gzip, but the body is not gzip: it ends inside its stream")
            data, self.pending = bytes(self.pending), bytearray()
            return await self.upload.write(data, last=True)
        except BaseException:
            await self.upload.abort()
            raise

    def whole_body(self) -> bytes:
        """A gathered body, as request.body."""
        self.check_signed_body()
        self.request.body = b"".join(self.gathered or [])
        self.gathered = []
        return self.request.body

    def on_connection_close(self) -> None:
        if self.upload is not None and not self.upload.done:  # the client went mid-upload
            asyncio.ensure_future(self.upload.abort())
        super().on_connection_close()

    def on_finish(self) -> None:
        if self.gathered_bytes:
            self.settings["budget"].give(self.gathered_bytes)
            self.gathered_bytes = 0
        super().on_finish()

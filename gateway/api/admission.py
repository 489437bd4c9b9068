"""What the gateway holds for its clients, and the door that refuses more.

One ``Budget`` per gateway counts the bytes it holds for clients: request
bodies being read (as they arrive), answers written but not yet flushed,
and websocket output not yet sent.
``SandgateApplication.find_handler`` runs once a request's headers are in,
before its body is read: a body over its bound gets 413 naming the bound,
and while the budget is spent a new request gets 503 with Retry-After,
neither reading the body into memory.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from tornado import httputil, web

from .. import metrics

log = logging.getLogger("sandgate.api")
RETRY_AFTER = 1  # seconds: what is held drains as fast as clients read
ALWAYS = ("/metrics", "/healthz", "/livez")  # an operator looks at a busy gateway through these


class Budget:
    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> None:
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n

    def spent(self) -> bool:
        return self.held >= self.limit


@web.stream_request_body
class RefuseHandler(web.RequestHandler):
    """A refusal decided from the headers. The body is read and dropped a chunk at a time, never
    held, then the answer goes out: a client still sending would otherwise meet a closed connection
    and never see the status (a body past SANDGATE_MAX_MESSAGE_MB is answered at once, and the
    connection closed)."""

    def initialize(self, status: int, code: str, message: str, retry_after: Optional[int] = None, drain=True):
        self.status, self.code, self.message, self.retry_after, self.drain = status, code, message, retry_after, drain

    def prepare(self):
        if not self.drain:
            self.answer()

    def data_received(self, chunk: bytes) -> None:
        pass

    def answer(self, *args) -> None:
        self.set_status(self.status)
        self.set_header("Content-Type", "application/json")
        if self.retry_after is not None:
            self.set_header("Retry-After", str(self.retry_after))
        if self.request.path.startswith(("/e2b/filesystem.", "/e2b/process.")):  # Connect's shape (api/e2b.py)
            body = {"code": "unavailable" if self.status == 503 else "resource_exhausted", "message": self.message}
        elif self.request.path.startswith("/e2b/"):  # E2B's error shape (api/e2b.py)
            body = {"code": self.status, "message": self.message}
        else:
            body = {"reason": self._reason, "message": self.message, "code": self.code}
        self.finish(json.dumps(body))

    get = head = post = put = patch = delete = options = answer


class Counted(httputil.HTTPMessageDelegate):
    """A request's delegate, with its body's bytes on the budget until the request is done (its
    handler's on_finish, or the connection closed). A handler that takes its body as it arrives
    (``holds_at_most``) holds a chunk of it, not all of it."""

    def __init__(self, inner: httputil.HTTPMessageDelegate, request: httputil.HTTPServerRequest, budget: Budget,
                 cap: Optional[int] = None):
        self.inner, self.budget, self.got, self.cap, self.held = inner, budget, 0, cap, 0
        request.release_budget = self.release  # AuthMixin.on_finish

    def headers_received(self, start_line, headers):
        return self.inner.headers_received(start_line, headers)

    def data_received(self, chunk: bytes):
        self.got += len(chunk)
        # Counted as it arrives, not reserved from Content-Length: a client that announces a big
        # body and trickles it must not spend the budget of everyone else with bytes it never sent.
        counted = self.got if self.cap is None else min(self.got, self.cap)
        if counted > self.held >= 0:
            self.budget.take(counted - self.held)
            self.held = counted
        return self.inner.data_received(chunk)

    def finish(self) -> None:
        self.inner.finish()
        # tornado's handler delegate keeps the chunks it joined into request.body for as long as the
        # request lasts (a cell's whole run): a second copy of every body, let go here.
        handler_delegate = getattr(self.inner, "delegate", None)
        if isinstance(getattr(handler_delegate, "chunks", None), list):
            handler_delegate.chunks = []

    def on_connection_close(self) -> None:
        self.release()
        self.inner.on_connection_close()

    def release(self) -> None:
        if self.held > 0:
            self.budget.give(self.held)
        self.held = -1  # once


def body_bound(handler_class, settings) -> tuple:
    """(bytes, the setting naming it) for a request to ``handler_class``."""
    own = getattr(handler_class, "max_body", None)
    if own:
        return own(settings)
    return settings.max_message_mb << 20, "SANDGATE_MAX_MESSAGE_MB"


class SandgateApplication(web.Application):
    def find_handler(self, request: httputil.HTTPServerRequest, **kwargs):
        delegate = super().find_handler(request, **kwargs)
        settings, budget = self.settings["sandgate"], self.settings["budget"]
        handler_class = getattr(delegate, "handler_class", None)
        try:
            length = int(request.headers.get("Content-Length", "0") or 0)
        except ValueError:
            length = 0  # tornado answers 400 for it
        bound, name = body_bound(handler_class, settings)
        largest = settings.max_message_mb << 20
        if length > bound:
            return self.get_handler_delegate(request, RefuseHandler, {
                "status": 413, "code": "too_large", "drain": length <= largest,
                "message": f"the body is {length} bytes; at most {bound >> 20} MiB ({name}) here"})
        if budget.spent() and request.path not in ALWAYS:
            metrics.BUSY.inc()
            log.warning("%s %s: 503, the gateway holds %d MiB for its clients, its bound (SANDGATE_CLIENT_MEMORY_MB)",
                        request.method, request.path, budget.held >> 20)
            return self.get_handler_delegate(request, RefuseHandler, {
                "status": 503, "code": "busy", "retry_after": RETRY_AFTER,
                "message": f"the gateway holds {budget.held >> 20} MiB for its clients, as much as it may "
                           f"(SANDGATE_CLIENT_MEMORY_MB={budget.limit >> 20}); retry in a moment"})
        request.connection.set_max_body_size(bound)  # a chunked body too
        return Counted(delegate, request, budget, getattr(handler_class, "holds_at_most", None))

"""Forwarding a request for a sandbox on another node of the fleet to that node.

The caller's own credentials do not go along: this node authenticated the
caller, and the request carries who the caller is, signed with the fleet key
for the node that holds the sandbox (core/fleetauth.py), which scopes it as if
it had come to it directly. Only a node whose heartbeat is signed with that key
is forwarded to (core/fleet.py), and a ``token`` in the query string is dropped.
``X-Sandgate-Forwarded`` names the node it came through and is never forwarded
again. Bodies stream both ways as they arrive: a streamed
execute's events, and kernel websocket frames, are not gathered first.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Dict, Optional
from urllib.parse import parse_qsl, urlencode

from tornado import httpclient, websocket
from tornado.httputil import HTTPHeaders

from .. import metrics
from ..core.fleet import Peer
from ..logformat import request_id

log = logging.getLogger("sandgate.forward")
FORWARDED = "X-Sandgate-Forwarded"
# What a request carries to the other node, and what comes back to the client. Not Origin: this
# node has checked it (and answers CORS itself); to the other node the request comes from this one.
# Not Authorization (nor a query's token): the fleet's signature stands for the caller there.
REQUEST_HEADERS = ("Content-Type", "Accept", "X-Request-Id")
CREDENTIAL_QUERY = ("token", "access_token", "api_key")
RESPONSE_HEADERS = ("Content-Type", "Location", "Retry-After", "Cache-Control", "Content-Disposition")
TIMEOUT = 3600.0  # an execute may run for its own timeout (at most an hour)


def forward_uri(uri: str) -> str:
    """``uri`` without credentials in its query string."""
    path, sep, query = uri.partition("?")
    if not sep:
        return uri
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k.lower() not in CREDENTIAL_QUERY]
    return path + ("?" + urlencode(kept) if kept else "")


def headers_for(handler, peer: Peer, method: Optional[str] = None, uri: Optional[str] = None,
                body: bytes = b"") -> dict:
    """The headers of ``handler``'s request (or of ``method`` ``uri`` on the caller's behalf) to
    ``peer``: signed for that node with the caller as this node authenticated it."""
    request = handler.request
    h = {k: request.headers[k] for k in REQUEST_HEADERS if k in request.headers}
    rid = request_id.get()
    if rid:  # the owner node logs the request under the same id
        h["X-Request-Id"] = rid
    auth = handler.settings["fleet"].auth
    h[FORWARDED] = auth.node
    h.update(auth.sign(method or request.method, uri or forward_uri(request.uri), body, peer.node, handler.who))
    return h


def unavailable(base_url: str, why: object) -> dict:
    """The 503 reason a client gets when the node holding its sandbox is gone mid-call."""
    return {"reason": "Service Unavailable", "code": "unavailable", "node": base_url,
            "message": f"the node holding this sandbox ({base_url}) is unreachable or went away: {why}; "
                       f"the request may be retried (an execute with the same id runs at most once)"}


async def forward_http(handler, peer: Peer) -> None:
    """Answer ``handler``'s request with the other node's answer. Event streams and file
    bodies stream as they arrive; a JSON answer is passed on whole, so that a node lost
    halfway still leaves the client a 503 with a reason rather than half a body."""
    req, base_url = handler.request, peer.url
    metrics.FORWARDED.labels("http").inc()
    status = {"code": 502, "reason": "Bad Gateway"}
    headers = HTTPHeaders()
    held: list = []  # a JSON body, until it is whole
    mode = {"hold": False, "stream": False}

    def on_header(line: str) -> None:
        if line.startswith("HTTP/"):
            parts = line.split(" ", 2)
            status["code"], status["reason"] = int(parts[1]), (parts[2].strip() if len(parts) > 2 else "")
            headers.clear()  # a 100 Continue's headers are not the answer's
        elif line.strip():
            headers.parse_line(line.rstrip("\r\n"))
        elif status["code"] != 100:  # the end of the headers
            kind = headers.get("Content-Type", "")
            mode["stream"] = kind.startswith("text/event-stream")
            mode["hold"] = kind.startswith("application/json")
            if not mode["hold"]:  # streamed: the client gets the headers now, before any body
                send_headers()

    def send_headers() -> None:
        handler.set_status(status["code"], status["reason"] or None)
        for name in RESPONSE_HEADERS:
            if name in headers:
                handler.set_header(name, headers[name])

    def on_chunk(chunk: bytes) -> None:
        if mode["hold"]:
            held.append(chunk)
            return
        if mode["stream"]:  # whole events only: a node lost mid-event leaves no half event behind
            held.append(chunk)
            whole = b"".join(held)
            cut = whole.rfind(b"\n\n") + 2
            held[:] = [whole[cut:]] if cut < len(whole) else []
            chunk = whole[:cut]
            if not chunk:
                return
        handler.write(chunk)
        handler.flush()

    body = req.body if req.method in ("POST", "PUT", "PATCH") else None
    uri = forward_uri(req.uri)
    fetch = httpclient.HTTPRequest(
        base_url.rstrip("/") + uri, method=req.method, headers=headers_for(handler, peer, req.method, uri, body or b""),
        body=body, allow_nonstandard_methods=True,
        request_timeout=TIMEOUT, header_callback=on_header, streaming_callback=on_chunk, decompress_response=False)
    try:
        # HTTPClientError (599): the connection closed before the answer was whole (a node killed mid-call)
        await httpclient.AsyncHTTPClient().fetch(fetch, raise_error=False)
    except (OSError, httpclient.HTTPClientError) as e:
        log.warning("%s %s: node at %s unreachable or gone mid-call: %s", req.method, req.path, base_url, e)
        reason = unavailable(base_url, e)
        if not handler._headers_written:
            handler.set_status(503)
            handler.set_header("Content-Type", "application/json")
            handler.write(reason)
        elif mode["stream"]:  # the stream's own last word: an error event, as the owner itself would send
            handler.write(f"event: error\ndata: {json.dumps(reason)}\n\n")
        handler.finish()
        return
    if mode["hold"] or held:
        if mode["hold"]:
            send_headers()
        handler.write(b"".join(held))
    handler.finish()


async def gather(handler, urls: Dict[str, str]) -> list:
    """The same GET (a list) from each of ``urls`` (node -> URL), concatenated;
    a node that does not answer is left out, and logged."""
    client = httpclient.AsyncHTTPClient()

    async def one(name: str, base: str) -> list:
        try:
            uri = forward_uri(handler.request.uri)
            r = await client.fetch(base.rstrip("/") + uri, headers=headers_for(handler, Peer(name, base), "GET", uri),
                                   request_timeout=10)
            return json.loads(r.body)
        except (OSError, httpclient.HTTPError, ValueError) as e:
            log.warning("GET %s: node %s left out of the list: %s", handler.request.path, name, e)
            return []

    metrics.FORWARDED.labels("list").inc(len(urls))
    parts = await asyncio.gather(*(one(n, u) for n, u in urls.items()))
    return [item for part in parts for item in part]


class Relay:
    """A kernel websocket to another node, relayed frame by frame both ways."""

    def __init__(self, client: websocket.WebSocketHandler, peer: Peer):
        self.client, self.peer, self.base_url = client, peer, peer.url
        self.upstream: Optional[websocket.WebSocketClientConnection] = None

    async def connect(self, subprotocol: Optional[str]) -> None:
        """The websocket to the owner node, made before the client's own handshake completes: once
        the client is connected it is attached there (as a direct client is at its open), so it
        gets every iopub message from then on, and a node that cannot be reached is an HTTP error."""
        metrics.FORWARDED.labels("websocket").inc()
        uri = forward_uri(self.client.request.uri)
        url = "ws" + self.base_url.rstrip("/")[4:] + uri
        request = httpclient.HTTPRequest(url, headers=headers_for(self.client, self.peer, "GET", uri))
        self.upstream = await websocket.websocket_connect(
            request, subprotocols=[subprotocol] if subprotocol else None,
            max_message_size=self.client.settings.get("websocket_max_message_size"))

    def start(self) -> None:
        """The client's handshake is done: frames flow both ways."""
        self.client.set_nodelay(True)
        self._pump()

    def _pump(self) -> None:
        async def run():
            while True:
                msg = await self.upstream.read_message()
                if msg is None:  # the other node closed it: so does this end
                    self.client.close(self.upstream.close_code, self.upstream.close_reason)
                    return
                try:
                    await self.client.write_message(msg, binary=isinstance(msg, bytes))
                except websocket.WebSocketClosedError:
                    self.upstream.close()
                    return

        from tornado.ioloop import IOLoop

        IOLoop.current().spawn_callback(run)

    def send(self, message) -> None:
        if self.upstream is not None:
            self.upstream.write_message(message, binary=isinstance(message, bytes))

    def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()

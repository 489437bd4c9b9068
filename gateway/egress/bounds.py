"""Bounds on what mitmproxy holds for one client connection of the egress proxy.

mitmproxy 11 reads what a client sends as fast as it arrives (it waits only on its own write buffers)
and keeps whatever no layer has consumed yet: an HTTP/1 head in its receive buffer until the blank line
ends it, with no limit ("FIXME: protect against header size DoS" in its ``_http1.py``), a TLS ClientHello
until it is whole (up to 16 MiB), and every event that arrives while a layer waits on a hook or on an
upstream connect. Code in a sandbox could make the gateway hold gigabytes (one 100 MiB head: +491 MB),
and an oversized head reached upstream. mitmproxy has no option for any of this, so a few small bounds:

- ``Gate`` (installed on each connection by the proxy's ``client_connected``): a client connection is not
  read while a hook or an upstream connect of its connection is in flight. Its bytes wait in the socket,
  and behind it in the agent's tunnel window, instead of in mitmproxy's queues: back-pressure, not a
  limit, so a large upload to an allowed host is never cut.
- HTTP/1 heads, both ways: a request head over ``HEAD_MAX`` bytes, a line of it over ``LINE_MAX`` or
  more than ``FIELDS_MAX`` header fields is answered 431 and the connection closed, before it is parsed,
  so it never reaches a hook or upstream; a response head over them is a 502. Nothing else may pile up in
  the receive buffer either (bytes sent ahead while a response is pending, a chunk-size line, trailers):
  past ``HEAD_MAX`` the connection is closed.
- a ClientHello over ``HELLO_MAX`` bytes fails the handshake.
- a WebSocket message over ``MESSAGE_MAX`` (mitmproxy reassembles each before relaying it) closes that
  WebSocket, and relayed messages are not kept (mitmproxy keeps them all for its UI).

The wrappers replace methods of mitmproxy's classes (once per process, as mitmproxy keeps one master per
process): the gateway runs the only proxy in it. mitmproxy is pinned (pyproject.toml), and
tests/security/test_hostile_egress.py fails if these stop taking effect.
"""

from __future__ import annotations

import asyncio
import re
from typing import Callable, Optional, Set

from h11._receivebuffer import ReceiveBuffer
from mitmproxy import http, version
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers.http import _http1
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import RequestProtocolError, ResponseProtocolError
from mitmproxy.proxy.layers.tls import ClientTLSLayer
from mitmproxy.proxy.layers.websocket import WebsocketLayer

HEAD_MAX = 64 << 10  # a request or response head: its first line, header fields and blank line
LINE_MAX = 16 << 10  # one line of a head (nginx's default is 8 KiB; long tokens and cookies exist)
FIELDS_MAX = 128  # header fields in one head (each is a few Python objects once parsed)
HELLO_MAX = 64 << 10  # a TLS ClientHello (a real one is a few KiB; OpenSSL refuses one over 128 KiB)
MESSAGE_MAX = 1 << 20  # one WebSocket message, which mitmproxy puts together before it relays it

# Told (client connection id, why) when a client connection is refused here; the proxy logs it with
# the sandbox's id.
on_refused: Callable[[str, str], None] = lambda client_id, why: None

_BLANK_LINE = re.compile(b"\n\r?\n")  # how h11's ReceiveBuffer finds a head's end


def head_problem(buf: ReceiveBuffer) -> Optional[str]:
    """Why the head at the start of ``buf`` is refused, or None (whole and within bounds, or not whole
    yet and within them so far)."""
    data = bytes(buf)[:HEAD_MAX + 1]
    end = _BLANK_LINE.search(data)
    if (end.end() if end else len(data)) > HEAD_MAX:
        return f"head over {HEAD_MAX} bytes"
    lines = data[:end.start() if end else len(data)].split(b"\n")
    if max(len(line) for line in lines) > LINE_MAX:
        return f"head line over {LINE_MAX} bytes"
    if len(lines) - 1 > FIELDS_MAX:  # the first line is the request or status line
        return f"head with over {FIELDS_MAX} header fields"
    return None


def _error_response(status: int, why: str) -> bytes:
    body = f"sandgate egress: refused: {why}\n"
    return http1.assemble_response(http.Response.make(status, body, {
        "Server": version.MITMPROXY, "Content-Type": "text/plain; charset=utf-8", "Connection": "close"}))


def _refuse(conn: "_http1.Http1Connection", why: str):
    """End an HTTP/1 connection whose unconsumed bytes passed a bound. A client that has not started a
    request gets a 431; a request or response in progress fails as on a protocol error (its flow errors,
    the client gets a 502 if no response started)."""
    conn.state = conn.done
    conn.buf = ReceiveBuffer()  # what was held is let go now, not when the connection is gone
    is_server = isinstance(conn, _http1.Http1Server)
    why = f"{'request' if is_server else 'response'} {why}"
    if is_server:
        on_refused(conn.context.client.id, why)
    if is_server and conn.request is None or not is_server and conn.stream_id is None:
        if is_server:
            yield commands.SendData(conn.conn, _error_response(431, why))
        yield commands.CloseConnection(conn.conn)
        return
    yield commands.CloseConnection(conn.conn)
    if is_server:
        yield ReceiveHttp(RequestProtocolError(conn.stream_id, why, 431))
    else:
        yield ReceiveHttp(ResponseProtocolError(conn.stream_id, why, 502))


def _bounded_read_headers(original):
    def read_headers(self, event):
        # Before mitmproxy looks for the head: one over the bounds is never parsed, hooked or forwarded.
        if isinstance(event, events.DataReceived) and (why := head_problem(self.buf)):
            yield from _refuse(self, why)
            return
        yield from original(self, event)
    read_headers.sandgate_bounded = True
    return read_headers


def _bounded_handle_event(original):
    def _handle_event(self, event):
        yield from original(self, event)
        # Whatever a state left unconsumed (a head in part, bytes sent ahead while a response is pending,
        # a chunk-size line, trailers) is bounded too. A passthrough buffers nothing.
        if isinstance(event, events.DataReceived) and len(self.buf) > HEAD_MAX and self.state != self.passthrough:
            if self.state == self.done:
                self.buf = ReceiveBuffer()  # the connection is closing; nothing will read these
            else:
                yield from _refuse(self, f"data unread over {HEAD_MAX} bytes")
    _handle_event.sandgate_bounded = True
    return _handle_event


def _bounded_handshake(original):
    def receive_handshake_data(self, data: bytes):
        if not self.client_hello_parsed and len(self.recv_buffer) + len(data) > HELLO_MAX:
            on_refused(self.context.client.id, f"TLS ClientHello over {HELLO_MAX} bytes")
            return False, f"ClientHello over {HELLO_MAX} bytes"
        done, err = yield from original(self, data)
        # mitmproxy's "Cannot parse ClientHello: <every byte in hex>" is logged as a warning: from a
        # sandbox, 128 KiB of the gateway's log per connection
        return done, err[:200] + "..." if err and len(err) > 200 else err
    receive_handshake_data.sandgate_bounded = True
    return receive_handshake_data


def _bounded_relay(original):
    def relay_messages(self, event):
        yield from original(self, event)
        # mitmproxy keeps every message of a WebSocket for its UI: the proxy has none, they go once relayed
        self.flow.websocket.messages.clear()
        held = max(sum(map(len, self.client_ws.frame_buf)), sum(map(len, self.server_ws.frame_buf)))
        if held > MESSAGE_MAX:
            on_refused(self.context.client.id, f"WebSocket message over {MESSAGE_MAX} bytes")
            self.client_ws.frame_buf = [b""]
            self.server_ws.frame_buf = [b""]
            self._handle_event = self.done
            yield commands.CloseConnection(self.context.client)
            yield commands.CloseConnection(self.context.server)
    relay_messages.sandgate_bounded = True
    return relay_messages


def install() -> None:
    """Wrap mitmproxy's methods, once per process."""
    for cls in (_http1.Http1Server, _http1.Http1Client):
        if not getattr(cls.read_headers, "sandgate_bounded", False):
            cls.read_headers = _bounded_read_headers(cls.read_headers)
    base = _http1.Http1Connection
    if not getattr(base._handle_event, "sandgate_bounded", False):
        base._handle_event = _bounded_handle_event(base._handle_event)
    if not getattr(WebsocketLayer.relay_messages, "sandgate_bounded", False):
        WebsocketLayer.relay_messages = _bounded_relay(WebsocketLayer.relay_messages)
    if not getattr(ClientTLSLayer.receive_handshake_data, "sandgate_bounded", False):
        ClientTLSLayer.receive_handshake_data = _bounded_handshake(ClientTLSLayer.receive_handshake_data)


class _Watched:
    """A connection's top layer, seen from its handler: notes which blocking commands (hooks, upstream
    connects) are in flight, so the gate knows when the layers are waiting."""

    def __init__(self, layer, gate: "Gate") -> None:
        self._layer, self._gate = layer, gate

    def handle_event(self, event):
        gate = self._gate
        if isinstance(event, events.CommandCompleted):
            gate.pending.discard(event.command)
        try:
            for command in self._layer.handle_event(event):
                if command.blocking:  # a blocking command, answered by a CommandCompleted later
                    gate.pending.add(command)
                yield command
        finally:
            if gate.pending:
                gate.idle.clear()
            else:
                gate.idle.set()

    def __getattr__(self, name):
        return getattr(self._layer, name)


class Gate:
    """The client socket as mitmproxy reads it: a read waits until no hook or connect is in flight.
    mitmproxy would otherwise queue every byte that arrives meanwhile (a 10 s resolution or a slow
    upstream connect at tunnel speed is gigabytes); this way it holds at most one read (64 KiB) more."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self.pending: Set[commands.Command] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    @classmethod
    def install(cls, handler) -> "Gate":
        """Put a gate on ``handler``'s client connection (from the ``client_connected`` hook, before
        mitmproxy starts reading it)."""
        io = handler.transports[handler.client]
        gate = cls(io.reader)
        io.reader = gate
        handler.layer = _Watched(handler.layer, gate)
        return gate

    async def read(self, n: int = -1) -> bytes:
        await self.idle.wait()
        return await self._reader.read(n)

"""The gateway's HTTP server: what a hostile client can make it hold.

tornado's ``HTTPServer`` waits an hour for a request's headers and accepts
every connection until the process is out of descriptors; an accept that
then fails (EMFILE) raises in the loop at every turn, logging a traceback
each time. ``BoundedHTTPServer`` adds to tornado's own timeouts:

- a cap on connections that are still HTTP (not yet a websocket), in total
  and per client address (IPv6 by /64): over either, the connection is
  answered 503 and closed at once. A websocket leaves the count at its
  upgrade, which needs a token, so long-lived kernel connections are not
  limited by it;
- accept errors caught, logged at most every ``LOG_EVERY`` seconds with a
  count, and accepting paused a moment so the loop does not spin;
- ``descriptor_headroom``: the soft RLIMIT_NOFILE raised to the hard one and
  the cap kept to half of it, so sandboxes, checkpoints and the store still
  get descriptors when every connection is taken.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import resource
import socket
import time
from typing import Dict, Iterable, Optional, Tuple

from tornado import httpserver, iostream
from tornado.ioloop import IOLoop

from . import metrics

log = logging.getLogger("sandgate")
LOG_EVERY = 10.0  # seconds between two log lines about refused connections or failed accepts
ACCEPT_PAUSE = 0.1  # seconds without accepting after an accept failed (EMFILE stays until a descriptor is free)
ACCEPT_BATCH = 128  # connections accepted per wake-up, as tornado's netutil does
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s")


def busy(message: str) -> bytes:
    body = b'{"reason": "Service Unavailable", "message": "%s"}' % message.encode()
    return BUSY % (len(body), body)


OVER_TOTAL = busy("too many connections")
OVER_CLIENT = busy("too many connections from this address")


def client_of(address) -> str:
    """Whose connection it is: the IPv4 address, or the /64 of an IPv6 one (one
    host holds a whole /64); "" for a unix socket."""
    host = address[0] if isinstance(address, tuple) and address else ""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class RateLimitedLog:
    """One log line at most every ``every`` seconds, carrying how many events it stands for."""

    def __init__(self, every: float = LOG_EVERY, clock=time.monotonic):
        self.every, self.clock = every, clock
        self.last: Optional[float] = None
        self.pending = 0

    def __call__(self, level: int, message: str, *args) -> None:
        self.pending += 1
        now = self.clock()
        if self.last is not None and now - self.last < self.every:
            return
        log.log(level, message + " (%d since the last such line)", *args, self.pending)
        self.last, self.pending = now, 0


class BoundedHTTPServer(httpserver.HTTPServer):
    def initialize(self, *args, max_connections: int = 0, max_connections_per_client: int = 0, **kwargs) -> None:
        super().initialize(*args, **kwargs)
        self.max_connections = max_connections  # 0: no cap
        self.max_per_client = max_connections_per_client
        self.open_by_client: Dict[str, int] = {}
        self.client_of_stream: Dict[iostream.IOStream, str] = {}
        self._refused = RateLimitedLog()
        self._accept_failed = RateLimitedLog()

    @property
    def open_connections(self) -> int:
        return len(self.client_of_stream)

    def handle_stream(self, stream: iostream.IOStream, address: Tuple) -> None:
        client = client_of(address)
        if self.max_connections and self.open_connections >= self.max_connections:
            return self._refuse(stream, OVER_TOTAL, "total", client)
        if self.max_per_client and self.open_by_client.get(client, 0) >= self.max_per_client:
            return self._refuse(stream, OVER_CLIENT, "client", client)
        self.client_of_stream[stream] = client  # before tornado's loop starts: it may end at once
        self.open_by_client[client] = self.open_by_client.get(client, 0) + 1
        metrics.HTTP_CONNECTIONS.set(self.open_connections)
        super().handle_stream(stream, address)

    def on_close(self, server_conn) -> None:
        # tornado calls this when a connection's HTTP request loop ends: closed, timed out, or upgraded
        # to a websocket (which from then on is its handler's).
        super().on_close(server_conn)
        client = self.client_of_stream.pop(server_conn.stream, None)
        if client is not None:
            left = self.open_by_client[client] - 1
            if left:
                self.open_by_client[client] = left
            else:
                del self.open_by_client[client]
        metrics.HTTP_CONNECTIONS.set(self.open_connections)

    def _refuse(self, stream: iostream.IOStream, answer: bytes, reason: str, client: str) -> None:
        metrics.HTTP_REFUSED.labels(reason).inc()
        self._refused(logging.WARNING, "refused a connection from %s: %s (at most %d, %d per client address)",
                      client or "a unix socket", "too many connections" if reason == "total" else
                      "too many connections from that address", self.max_connections, self.max_per_client)
        try:
            stream.socket.send(answer)  # a few bytes into an empty send buffer: never blocks
        except OSError:
            pass
        stream.close()

    # -- accepting -------------------------------------------------------------
    def add_sockets(self, sockets: Iterable[socket.socket]) -> None:
        for sock in sockets:
            self._sockets[sock.fileno()] = sock
            self._handlers[sock.fileno()] = self._accept_handler(sock)

    def _accept_handler(self, sock: socket.socket):
        """tornado's netutil.add_accept_handler, with accept errors caught: logged at a
        bounded rate, and the socket left alone for ACCEPT_PAUSE (a full descriptor table
        stays full until something closes; the pending connection waits in the backlog)."""
        loop = IOLoop.current()
        state = {"removed": False, "watching": True}

        def resume() -> None:
            if not state["removed"] and not state["watching"]:
                loop.add_handler(sock, on_ready, IOLoop.READ)
                state["watching"] = True

        def on_ready(fd, events) -> None:
            for _ in range(ACCEPT_BATCH):
                if state["removed"]:
                    return
                try:
                    connection, address = sock.accept()
                except BlockingIOError:
                    return
                except ConnectionAbortedError:
                    continue
                except OSError as e:
                    metrics.HTTP_REFUSED.labels("accept").inc()
                    self._accept_failed(logging.ERROR, "cannot accept connections: %s; pausing accepts for %g s",
                                        errno.errorcode.get(e.errno, str(e.errno)) + f" ({e.strerror})", ACCEPT_PAUSE)
                    loop.remove_handler(sock)
                    state["watching"] = False
                    loop.call_later(ACCEPT_PAUSE, resume)
                    return
                self._handle_connection(connection, address)

        def remove() -> None:
            if state["watching"]:
                loop.remove_handler(sock)
            state["removed"] = True

        loop.add_handler(sock, on_ready, IOLoop.READ)
        return remove


def descriptor_headroom(max_connections: int) -> Tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one, and return (the cap on
    connections, the limit): the cap is kept to half the limit, the other half
    for sandboxes (their streams, pipes and consoles), checkpoints and the store."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, e)
    if max_connections > soft // 2:
        log.warning("SANDGATE_HTTP_MAX_CONNECTIONS %d is more than half the descriptor limit (%d): %d instead",
                    max_connections, soft, soft // 2)
        max_connections = soft // 2
    return max_connections, soft

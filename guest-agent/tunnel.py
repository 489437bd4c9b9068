"""TCP connections carried over the agent's one framed stream (``tunnel`` frames).

Both ends use this module: the agent, for each connection a client inside the
sandbox makes to its egress listener, and the gateway, for the connection it
opens to the egress proxy for it. One ``Mux`` per stream; see TunnelFrame in
protocol.py and docs/protocol.md ("Egress tunnels").

Flow control is per connection and credit based: a side may have at most
``window`` bytes of data sent and not yet acknowledged, and a receiver
acknowledges bytes once its local socket has taken them (its transport buffer
drained below the low-water mark). So a client that does not read, or a peer
that does not, stops its sender after one window, memory stays bounded
(connections x window on each side), and a busy connection never holds up
the frames behind it: received data is written without waiting, and only
that connection's own sender waits for credit. A peer that sends past the
window, or frames for a connection it did not open, breaks only that
connection.

Needs only the standard library and protocol.py (the guest's Python and
pydantic 1.10 included).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Awaitable, Callable, Dict, Optional, Set, Tuple

try:
    from . import protocol as P
except ImportError:  # the agent run as a script
    import protocol as P  # type: ignore

WINDOW = 256 << 10  # unacknowledged bytes per connection and direction
CHUNK = 64 << 10  # the largest data frame
MAX_CONNS = 128  # connections at once per stream

Send = Callable[[bytes], Awaitable[None]]
Opener = Callable[[], Awaitable[Tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


def frame(conn: int, op: str, payload: bytes = b"", n: int = 0, error: Optional[str] = None) -> bytes:
    return P.encode(P.TunnelFrame(conn=conn, op=op, n=n, error=error), payload)


class Conn:
    """One tunnelled connection: a local socket (once there) and its state."""

    def __init__(self, cid: int, window: int):
        self.id = cid
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None
        self.credit = window  # bytes we may still send before the peer acknowledges
        self.credit_ev = asyncio.Event()
        self.early: list = []  # the peer's data before the local socket is there
        self.unacked = 0  # the peer's bytes received and not yet acknowledged
        self.peer_eof = False  # the peer sends no more
        self.local_eof = False  # we send no more
        self.pump: Optional[asyncio.Task] = None
        self.flusher: Optional[asyncio.Task] = None
        self.sent = self.received = 0


class Mux:
    """The connections of one stream. ``send`` writes one encoded frame to the
    stream. ``opener``, on the side that answers ``open`` frames (the
    gateway), makes the local connection; without one, ``open`` is refused."""

    def __init__(self, send: Send, opener: Optional[Opener] = None, window: int = WINDOW, chunk: int = CHUNK,
                 max_conns: int = MAX_CONNS):
        self.send, self.opener = send, opener
        self.window, self.chunk, self.max_conns = window, chunk, max_conns
        self.conns: Dict[int, Conn] = {}
        self._next = 1
        self._tasks: Set[asyncio.Future] = set()
        self.opened = 0  # connections ever opened, for tests and ping

    def _spawn(self, coro) -> asyncio.Future:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _send_quietly(self, data: bytes) -> None:
        try:
            await self.send(data)
        except Exception:  # the stream is gone: so is every connection on it
            pass

    # -- the side that accepts clients (the agent) ----------------------------------
    def full(self) -> bool:
        return len(self.conns) >= self.max_conns

    async def connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        """A local client connected: tell the peer, then carry its bytes."""
        cid = self._next
        self._next += 1
        c = self.conns[cid] = Conn(cid, self.window)
        self.opened += 1
        await self.send(frame(cid, "open"))
        if self.conns.get(cid) is c:  # not closed meanwhile
            self._attach(c, reader, writer)
        else:
            _abort(writer)
        return cid

    # -- frames from the peer --------------------------------------------------------
    def on_frame(self, f: "P.TunnelFrame", payload: bytes) -> None:
        """Handle one frame; never waits (the stream's reader calls it)."""
        c = self.conns.get(f.conn)
        if f.op == "open":
            if c is not None or self.opener is None or self.full():
                why = ("connection id in use" if c is not None else "egress is off" if self.opener is None
                       else f"too many connections ({self.max_conns})")
                self._spawn(self._send_quietly(frame(f.conn, "close", error=why)))
                return
            c = self.conns[f.conn] = Conn(f.conn, self.window)
            self.opened += 1
            self._spawn(self._open(c))
            return
        if c is None:
            return  # closed here already; the peer learns it from our close
        if f.op == "data":
            if c.peer_eof or c.unacked + sum(len(b) for b in c.early) + len(payload) > self.window:
                self._close(c, "data past the window or after eof", tell_peer=True)
                return
            c.received += len(payload)
            if c.writer is None:
                c.early.append(payload)
            else:
                self._write(c, payload)
        elif f.op == "ack":
            c.credit = min(self.window, c.credit + max(0, f.n))
            c.credit_ev.set()
        elif f.op == "eof":
            c.peer_eof = True
            if c.writer is not None:
                self._write_eof(c)
        elif f.op == "close":
            self._close(c, None, tell_peer=False)

    async def _open(self, c: Conn) -> None:
        try:
            reader, writer = await self.opener()
        except Exception as e:
            if self.conns.get(c.id) is c:
                self._close(c, f"could not reach the egress proxy: {type(e).__name__}: {e}", tell_peer=True)
            return
        if self.conns.get(c.id) is not c:  # closed by the peer while connecting
            _abort(writer)
            return
        self._attach(c, reader, writer)

    # -- the local socket ----------------------------------------------------------
    def _attach(self, c: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        c.reader, c.writer = reader, writer
        early, c.early = c.early, []
        for data in early:
            self._write(c, data)
        if c.peer_eof:
            self._write_eof(c)
        c.pump = self._spawn(self._pump(c))

    def _write(self, c: Conn, data: bytes) -> None:
        """Write the peer's bytes without waiting; acknowledge them once the
        socket has taken them."""
        try:
            c.writer.write(data)
        except (ConnectionError, OSError, RuntimeError) as e:
            self._close(c, f"{type(e).__name__}: {e}", tell_peer=True)
            return
        c.unacked += len(data)
        if c.flusher is None:
            c.flusher = self._spawn(self._flush(c))

    async def _flush(self, c: Conn) -> None:
        try:
            while c.unacked and self.conns.get(c.id) is c:
                await c.writer.drain()
                n, c.unacked = c.unacked, 0
                await self.send(frame(c.id, "ack", n=n))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._close(c, f"{type(e).__name__}: {e}", tell_peer=True)
        finally:
            c.flusher = None

    def _write_eof(self, c: Conn) -> None:
        try:
            if c.writer.can_write_eof():
                c.writer.write_eof()  # after what is buffered
        except (ConnectionError, OSError, RuntimeError):
            pass
        if c.local_eof:
            self._finish(c)

    async def _pump(self, c: Conn) -> None:
        """Local bytes to the peer, at most ``window`` ahead of its acks."""
        try:
            while True:
                while c.credit <= 0:
                    c.credit_ev.clear()
                    await c.credit_ev.wait()
                data = await c.reader.read(min(self.chunk, c.credit))
                if not data:
                    break
                c.credit -= len(data)
                c.sent += len(data)
                await self.send(frame(c.id, "data", data))
            c.local_eof = True
            await self.send(frame(c.id, "eof"))
            if c.peer_eof:
                self._finish(c)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the socket failed (reset), or the stream did
            self._close(c, f"{type(e).__name__}: {e}", tell_peer=True)

    def _finish(self, c: Conn) -> None:
        """Both directions ended: close the socket once it has written what it holds."""
        if self.conns.get(c.id) is not c:
            return
        del self.conns[c.id]

        async def close_when_flushed():
            try:
                await asyncio.wait_for(c.writer.drain(), 30)
            except Exception:
                pass
            c.writer.close()

        self._spawn(close_when_flushed())

    def _close(self, c: Conn, error: Optional[str], tell_peer: bool) -> None:
        """End one connection at once: its socket is aborted (a reset, not a
        quiet end, so a client mid-request sees it failed), its tasks
        cancelled, and the peer told unless it told us."""
        if self.conns.get(c.id) is not c:
            return
        del self.conns[c.id]
        current = asyncio.current_task()
        for t in (c.pump, c.flusher):
            if t is not None and t is not current:
                t.cancel()
        if c.writer is not None:
            _abort(c.writer)
        c.early = []
        if tell_peer:
            self._spawn(self._send_quietly(frame(c.id, "close", error=error)))

    async def close_all(self, error: str, tell_peer: bool = True) -> int:
        """Abort every connection; with ``tell_peer``, the close frames are
        written before this returns. Returns how many there were."""
        conns = list(self.conns.values())
        for c in conns:
            self._close(c, error, tell_peer=False)
        if tell_peer:
            for c in conns:
                await self._send_quietly(frame(c.id, "close", error=error))
        return len(conns)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset: no FIN_WAIT or TIME_WAIT left behind (this runsc
    cannot checkpoint a TCP endpoint in any state), and a client waiting for
    an answer learns at once that none is coming."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()

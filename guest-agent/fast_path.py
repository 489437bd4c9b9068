"""Small shell requests written to the kernel's pipe by the stdin thread itself."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

try:
    from . import protocol as P
    from .diagnostics import TRACE
except ImportError:  # run as a script
    import protocol as P  # type: ignore
    from diagnostics import TRACE  # type: ignore


if TYPE_CHECKING:
    from .agent import Agent


class ShellFastPath:
    """Shell requests from the gateway written to the kernel's pipe by the
    stdin thread itself. Handing each to the event loop costs a self-pipe
    write, an epoll wake-up and a GIL hand-off: ~1 ms of a cell's round trip
    in a gVisor sandbox (docs/performance.md).

    A frame goes straight to the kernel only when it is a shell message of at
    most SMALL bytes, the kernel is ready and on its pipe, the pipe's queue is
    not full, and no shell frame handed to the loop earlier is still unsent
    (so shell requests keep their order). Writing never blocks this thread
    (KP.AgentEnd queues what the kernel has not read yet), so it always goes
    back to reading the stream. Everything else goes to the loop as before, in stream order; a
    frame that is not whole yet waits here unless it goes to the loop, which
    gets its bytes as they come (a file write is never held twice). After
    anything that does not parse, the rest of the stream goes to the loop,
    which ends the connection as it would have."""

    SMALL = 1 << 20

    def __init__(self, agent: "Agent"):
        self.agent = agent
        self.buf = bytearray()
        self.forward_left = 0  # bytes of a frame going to the loop still to come
        self.passthrough = False
        self.handed = 0  # shell frames handed to the loop, not yet sent by it
        self.out: list[bytes] = []  # what take() has for the loop so far
        self.count_lock = threading.Lock()

    def hand_one(self) -> None:
        """A shell frame goes to the loop (counted before the loop can see it)."""
        with self.count_lock:
            self.handed += 1

    def sent_one(self) -> None:
        with self.count_lock:
            self.handed -= 1

    def take(self, data: bytes, read_at: float) -> bytes:
        """Of what the stdin thread read, the bytes the event loop must see."""
        if self.passthrough:
            return data
        self.out = out = []
        if self.forward_left:
            n = min(self.forward_left, len(data))
            out.append(data[:n])
            self.forward_left -= n
            data = data[n:]
        self.buf += data
        buf = self.buf
        while len(buf) >= P.PREFIX.size:
            hlen, plen = P.PREFIX.unpack_from(buf)
            start = P.PREFIX.size + hlen
            if hlen > P.MAX_HEADER or plen > P.MAX_PAYLOAD:
                self.passthrough = True
                break
            if len(buf) < start:
                break
            try:
                frame = P.parse_header(bytes(buf[P.PREFIX.size:start]))
            except P.ProtocolError:
                self.passthrough = True
                break
            end = start + plen
            shell = isinstance(frame, P.KernelFrame) and frame.channel == "shell"
            if shell and plen <= self.SMALL:
                if len(buf) < end:
                    break
                if not self.direct(frame, bytes(buf[start:end]), read_at):
                    self.hand_one()
                    out.append(bytes(buf[:end]))
                del buf[:end]
                continue
            if shell:
                self.hand_one()
            n = min(end, len(buf))
            out.append(bytes(buf[:n]))
            del buf[:n]
            self.forward_left = end - n
            if self.forward_left:
                break
        if self.passthrough:
            out.append(bytes(buf))
            buf.clear()
        self.out = []
        return b"".join(out)

    def give_up(self) -> bytes:
        """After a failure inside take: what it had not yet handed on, and
        the loop sees everything from now on."""
        self.passthrough = True
        rest = b"".join(self.out) + bytes(self.buf)
        self.out, self.buf = [], bytearray()
        return rest

    def direct(self, frame: P.KernelFrame, payload: bytes, read_at: float) -> bool:
        """Whether the frame went to the kernel; if not, the loop sends it."""
        a, k = self.agent, self.agent.kernel
        pipe = k.pipe
        if not (a.ready.is_set() and k.on_pipe and pipe is not None and not pipe.full and not self.handed):
            return False
        try:
            parts = P.split_parts(frame, payload)
        except P.ProtocolError:
            return False  # the loop says so and ends the connection
        TRACE.on = frame.trace is not None
        stamps = a.trace_in(frame, parts, read_at) if TRACE.on else None
        try:
            pipe.write(k.pipe_frame(k.session.sign(parts[:4]), parts))
        except OSError:  # a kernel restarting under it: the loop sends it once one is ready
            return False
        if stamps is not None:
            stamps["ag_zmq"] = time.time()
        return True

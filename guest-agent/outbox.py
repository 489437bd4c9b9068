"""Frames to the gateway, buffered up to a bound while no gateway is attached."""

from __future__ import annotations

import asyncio
import collections

try:
    from . import protocol as P
    from .diagnostics import log
except ImportError:  # run as a script
    import protocol as P  # type: ignore
    from diagnostics import log  # type: ignore


class Outbox:
    """Frames to the gateway: written when attached, buffered when not."""

    def __init__(self, max_frames: int, max_bytes: int):
        self.writer = None  # asyncio.StreamWriter or BlockingWriter
        self.buffer: collections.deque[bytes] = collections.deque()
        self.buffered_bytes = 0
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.dropped = 0
        self.dropped_bytes = 0

    async def send(self, data: bytes) -> None:
        await self.send_all([data])

    async def send_all(self, frames: list[bytes]) -> None:
        """Frames in one write: each write to the stream wakes the shim and the
        gateway on the host, and costs the sandbox a trip through the Sentry."""
        w = self.writer
        if w is not None and getattr(w, "is_closing", lambda: False)():
            w = self.writer = None  # asyncio swallows write errors on a dead socket
        if w is not None:
            try:
                w.write(frames[0] if len(frames) == 1 else b"".join(frames))
                await w.drain()
                return
            except (ConnectionError, OSError):
                self.writer = None
                log("stream lost; buffering")
        for data in frames:
            self._keep(data)

    def _keep(self, data: bytes) -> None:
        # Past the bound, newer frames are dropped: the buffered prefix stays
        # a consistent history, and the gateway is told how much is missing.
        if len(self.buffer) >= self.max_frames or self.buffered_bytes + len(data) > self.max_bytes:
            self.dropped += 1
            self.dropped_bytes += len(data)
            return
        self.buffer.append(data)
        self.buffered_bytes += len(data)

    async def attach(self, writer: asyncio.StreamWriter) -> None:
        if self.dropped:
            writer.write(P.encode(P.EventFrame(event="dropped", data={
                "frames": self.dropped, "bytes": self.dropped_bytes})))
            self.dropped = self.dropped_bytes = 0
        while self.buffer:
            writer.write(self.buffer.popleft())
        self.buffered_bytes = 0
        self.writer = writer
        await writer.drain()

    def detach(self) -> None:
        self.writer = None

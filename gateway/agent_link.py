"""The gateway's end of one guest agent's stream.

Reads frames in one task, hands kernel messages and events to callbacks, and
matches responses to requests by id. Knows nothing of Jupyter or HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from typing import Awaitable, Callable, Dict, List, Optional, Tuple

from sandgate_agent import protocol as P
from sandgate_agent import tunnel as T

from . import trace

log = logging.getLogger("sandgate.agent_link")

KernelCallback = Callable[[str, List[bytes]], None]
EventCallback = Callable[[P.EventFrame], None]
# Opens the host side of one egress connection the agent carries (the egress
# proxy's); see core/tunnel.py.
TunnelOpener = Callable[[], Awaitable[Tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class AgentError(Exception):
    """The agent answered a request with an error, or is gone. ``code`` names
    the error's kind: the agent's exception class (``FileNotFoundError``), or
    ``stream`` when the agent could not be reached at all."""

    def __init__(self, message: str, code: str = "stream"):
        super().__init__(message)
        self.code = code


def _code_of(error: str) -> str:
    """The agent reports ``<ExceptionClass>: <message>``."""
    head, sep, _ = error.partition(": ")
    return head if sep and head.isidentifier() else "error"


class AgentLink:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_kernel: KernelCallback, on_event: EventCallback, tunnel_opener: Optional[TunnelOpener] = None):
        self.reader, self.writer = reader, writer
        self.on_kernel, self.on_event = on_kernel, on_event
        # Egress connections the agent carries on this stream; without an
        # opener every `open` is refused.
        self.tunnels = T.Mux(self._send_frame, tunnel_opener)
        # Ids start anywhere in 2**48: the agent keeps its answers while no gateway is
        # attached and gives them to the next link, whose ids must not meet the last one's.
        self._ids = itertools.count(secrets.randbits(48) + 1)
        self._pending: Dict[int, asyncio.Future] = {}
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        reason = "stream closed"
        try:
            while True:
                frame, payload = await P.read_frame(self.reader)
                if isinstance(frame, P.KernelFrame):
                    parts = P.split_parts(frame, payload)
                    if frame.trace is None:
                        self.on_kernel(frame.channel, parts)
                    else:
                        t = time.time()
                        self.on_kernel(frame.channel, parts)
                        trace.delivered(frame.channel, parts, frame.trace, t)
                elif isinstance(frame, P.ResponseFrame):
                    fut = self._pending.pop(frame.id, None)
                    if fut and not fut.done():
                        fut.set_result((frame, payload))
                elif isinstance(frame, P.EventFrame):
                    if frame.event == "ready" and not self.ready.done():
                        self.ready.set_result(frame.data)
                    self.on_event(frame)
                elif isinstance(frame, P.TunnelFrame):
                    self.tunnels.on_frame(frame, payload)
        except EOFError:
            pass
        except P.ProtocolError as e:
            reason = f"protocol error from agent: {e}"
            log.error(reason)
        except (ConnectionError, OSError) as e:
            reason = f"stream error: {e}"
        except Exception:  # a callback bug must not wedge the link silently
            log.exception("agent link reader failed")
            reason = "internal error reading the agent stream"
        finally:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        # Every tunnelled connection ends with the stream (the agent aborts its side).
        asyncio.ensure_future(self.tunnels.close_all(reason, tell_peer=False))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(AgentError(reason))
        self._pending.clear()
        if not self.ready.done():
            self.ready.set_exception(AgentError(reason))
            self.ready.exception()  # retrieved: nobody may be awaiting it
        if not self.closed.done():
            self.closed.set_result(reason)

    async def _send_frame(self, data: bytes) -> None:
        """One tunnel frame. Its connection waits for the pipe to drain; kernel
        messages (send_kernel) never do."""
        if self.closed.done():
            raise ConnectionError("agent stream is closed")
        self.writer.write(data)
        await self.writer.drain()

    def send_kernel(self, channel: str, parts: List[bytes]) -> None:
        if self.closed.done():
            raise AgentError("agent stream is closed")
        try:
            head = P.kernel_head(channel, parts, trace.request_stamps(parts))
        except P.ProtocolError as e:
            raise AgentError(str(e), "FrameTooLarge") from None
        # The parts as they are, not joined into one frame (writelines joins too): a big message is
        # not copied here, only what the socket does not take at once is, into the transport's buffer.
        self.writer.write(head)
        for part in parts:
            self.writer.write(part)

    async def request(self, op: str, args: Optional[dict] = None, payload: bytes = b"",
                      timeout: float = 60.0) -> Tuple[dict, bytes]:
        if self.closed.done():
            raise AgentError("agent stream is closed")
        rid = next(self._ids)
        try:
            frame = P.encode(P.RequestFrame(id=rid, op=op, args=args or {}), payload)
        except P.ProtocolError as e:  # nothing was sent: the caller's request is too big, not the stream broken
            raise AgentError(str(e), "FrameTooLarge") from None
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self.writer.write(frame)
        del frame
        try:
            await self.writer.drain()
            frame, data = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise AgentError(f"agent did not answer {op} within {timeout:g} s") from None
        except (ConnectionError, OSError) as e:
            raise AgentError(f"agent stream error: {e}") from None
        finally:
            self._pending.pop(rid, None)
        if not frame.ok:
            error = frame.error or f"{op} failed"
            raise AgentError(error, getattr(frame, "code", None) or _code_of(error))
        return frame.result, data

    async def close(self) -> None:
        self._task.cancel()
        try:
            self.writer.close()
        except Exception:
            pass
        self._fail("closed by the gateway")

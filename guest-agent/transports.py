"""The streams the agent serves the gateway on: ``stdio`` (gVisor: the sandbox's
stdin/stdout), ``unix:PATH`` and ``vsock:PORT`` (listen, one gateway at a
time), ``serial:DEVICE`` (a virtio-serial port, reopened after each hangup)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

try:
    from . import protocol as P
    from .diagnostics import TRACE, log
    from .fast_path import ShellFastPath
except ImportError:  # run as a script
    import protocol as P  # type: ignore
    from diagnostics import TRACE, log  # type: ignore
    from fast_path import ShellFastPath  # type: ignore


if TYPE_CHECKING:
    from .agent import Agent


class BlockingWriter:
    """Blocking writes to a pipe, with the StreamWriter calls Outbox uses.

    Used for stdio instead of asyncio's pipe transports: a gVisor sandbox
    restored from a checkpoint gets new host pipes, and this runsc does not
    re-arm readiness notifications for them, so an epoll-driven stream
    stalls after the first read. Plain blocking reads and writes work."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, True)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        os.close(self.fd)


async def stdio_streams(fast: ShellFastPath | None = None):
    loop = asyncio.get_running_loop()
    # Keep the real stdout for frames only; anything else printed goes to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    reader = asyncio.StreamReader(limit=P.MAX_PAYLOAD)
    os.set_blocking(0, True)

    def pump_stdin() -> None:  # see BlockingWriter for why this is a thread
        while True:
            try:
                data = os.read(0, 1 << 20)
            except OSError:
                data = b""
            if not data:
                loop.call_soon_threadsafe(reader.feed_eof)
                return
            read_at = time.time()
            if TRACE.on:
                TRACE.read_at = read_at
            if fast is not None:
                try:
                    data = fast.take(data, read_at)
                except Exception as e:  # never lose the stream over the fast path
                    log(f"shell fast path failed, handing the stream to the loop: {type(e).__name__}: {e}")
                    data = fast.give_up()
                if not data:
                    continue
            loop.call_soon_threadsafe(reader.feed_data, data)

    threading.Thread(target=pump_stdin, name="stdin", daemon=True).start()
    return reader, BlockingWriter(out_fd)


class ResetIsEnd(asyncio.StreamReaderProtocol):
    """A gateway that closes its socket with our frames still unread resets
    the stream (unix and vsock sockets do). What it wrote before the close
    still counts: asyncio would raise the reset ahead of the bytes it has
    buffered, losing a request the gateway sent last, so the reset ends the
    stream the way an end of file does, after those bytes."""

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(None if isinstance(exc, ConnectionResetError) else exc)


async def serve(agent: Agent, transport: str, ready: bytes) -> None:
    """Serve gateways on ``transport``, each sent ``ready`` first; returns when
    a stdio stream ends (the sandbox then stops), otherwise never."""
    kind, _, where = transport.partition(":")
    if kind == "stdio":
        agent.fast = ShellFastPath(agent)
        reader, writer = await stdio_streams(agent.fast)
        writer.write(ready)
        why = await agent.serve(reader, writer)
        log(f"{why}; stopping")
        await agent.kernel.kill()
        return
    if kind == "serial":  # the device persists; reopen after each hangup (a restore, a new gateway process)
        loop = asyncio.get_running_loop()
        while True:
            try:
                fd = os.open(where, os.O_RDWR | os.O_NOCTTY)
            except OSError as e:  # the agent is the VM's init: an exception here would panic the guest
                log(f"cannot open {where}: {e}; retrying")
                await asyncio.sleep(0.2)
                continue
            reader = asyncio.StreamReader(limit=P.MAX_PAYLOAD)
            rt, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
            t, proto = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(os.dup(fd), "wb", 0))
            writer = asyncio.StreamWriter(t, proto, reader, loop)
            writer.write(ready)
            await agent.serve(reader, writer)
            # Both descriptors closed: the port takes one opener at a time (EBUSY otherwise).
            writer.close()
            rt.close()
            await asyncio.sleep(0.2)

    async def on_connect(reader, writer):
        writer.write(ready)
        await agent.serve(reader, writer)
        writer.close()

    loop = asyncio.get_running_loop()

    def protocol():
        return ResetIsEnd(asyncio.StreamReader(limit=P.MAX_PAYLOAD), on_connect)

    if kind == "unix":
        server = await loop.create_unix_server(protocol, path=where)
    elif kind == "vsock":
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        sock.bind((socket.VMADDR_CID_ANY, int(where)))
        server = await loop.create_server(protocol, sock=sock)
    else:
        raise SystemExit(f"unknown transport {transport!r}")
    async with server:
        await server.serve_forever()

"""The pipe between the agent and its kernel for the shell and IOPub channels.

Why not ZMQ: inside a gVisor sandbox on the ptrace platform every system call
costs ~0.04 ms, and a message over ZMQ ipc costs dozens of them on each side
(the sending thread wakes the I/O thread through its mailbox, the I/O thread
polls and writes, the receiving I/O thread reads and wakes the reader, and
libzmq checks ``getpid`` on every mailbox operation): 3-4 ms per message from
the kernel to the agent (docs/performance.md). Over this pipe a message is one
``send`` by the thread that made it and one ``recv`` by the agent's event loop.

One unix socketpair per kernel, inherited by the kernel as a descriptor; the
agent's end is non-blocking (its event loop reads whatever has arrived, and
forwards all of it to the gateway in one write), the kernel's is blocking (a
writer waits while the agent is behind instead of dropping). Each message is
one frame: ``<channel:u8><body length:u32>`` then the body, a sequence of
``<part length:u32><part>``, the Jupyter message's parts as ZMQ would carry
them. Frames are written whole under a lock, so writers on several threads
never interleave.

Control, stdin and the heartbeat stay on ZMQ: they are off the hot path, and
ipykernel polls stdin with ``zmq.select``.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

HEAD = struct.Struct("<BI")
PART = struct.Struct("<I")
HELLO, SHELL, IOPUB = 0, 1, 2
CHANNELS = {SHELL: "shell", IOPUB: "iopub"}
ENV = "SANDGATE_KERNEL_PIPE"  # the kernel's end, a descriptor number
READ_SIZE = 1 << 16


class PipeError(Exception):
    """A frame whose parts do not add up to its length."""


def encode(channel: int, parts) -> bytes:
    """One frame. ``parts`` may be bytes or anything with the buffer protocol
    (zmq.Frame, memoryview), as ipykernel's Session hands them to a socket."""
    chunks = []
    size = 0
    for p in parts:
        b = p if isinstance(p, bytes) else bytes(memoryview(p))
        chunks.append(PART.pack(len(b)))
        chunks.append(b)
        size += PART.size + len(b)
    return HEAD.pack(channel, size) + b"".join(chunks)


def decode_body(body: bytes | memoryview) -> list[bytes]:
    parts, i, n = [], 0, len(body)
    while i < n:
        if n - i < PART.size:
            raise PipeError("a part's length is cut short")
        (size,) = PART.unpack_from(body, i)
        i += PART.size
        if size > n - i:
            raise PipeError(f"a part of {size} bytes in {n - i} left")
        parts.append(bytes(body[i:i + size]))
        i += size
    return parts


class Decoder:
    """Frames out of a byte stream read in arbitrary pieces, one result per
    frame: ``(channel, parts)``; for a body over ``cap`` bytes
    ``(channel, None)``, read past without being held; for a body whose parts
    do not add up ``(channel, PipeError)``. The frame's length keeps the
    decoder in step either way: code in the kernel holds its end too."""

    def __init__(self, cap: int | None = None):
        self.buf = bytearray()
        self.cap = cap
        self.skip = 0  # bytes left of a body over the cap

    def feed(self, data: bytes) -> list[tuple[int, list[bytes] | None | PipeError]]:
        out, i = [], 0
        if self.skip:
            n = min(self.skip, len(data))
            self.skip -= n
            data = data[n:]
        self.buf += data
        while len(self.buf) - i >= HEAD.size:
            channel, size = HEAD.unpack_from(self.buf, i)
            start = i + HEAD.size
            if self.cap is not None and size > self.cap:
                out.append((channel, None))
                n = min(size, len(self.buf) - start)
                self.skip = size - n
                i = start + n
                continue
            if len(self.buf) - start < size:
                break
            # The view is released before the buffer is cut, error or not.
            with memoryview(self.buf) as view, view[start:start + size] as body:
                try:
                    out.append((channel, decode_body(body)))
                except PipeError as e:
                    out.append((channel, PipeError(str(e))))  # without the traceback that holds the view
            i = start + size
        del self.buf[:i]
        return out


class KernelEnd:
    """The kernel's end: blocking sends of whole frames from any thread."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(True)
        self.lock = threading.Lock()
        # A child forked while another thread held the lock would find it held
        # forever; the child gets its own (and ipykernel keeps forked children
        # off IOPub anyway: _is_master_process).
        os.register_at_fork(after_in_child=self._new_lock)

    def _new_lock(self) -> None:
        self.lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, channel: int, parts) -> None:
        data = encode(channel, parts)
        with self.lock:
            self.sock.sendall(data)

    def recv_ready(self) -> bytes | None:
        """What the agent has written so far, without waiting; b'' at EOF,
        None when there is nothing yet."""
        try:
            # 64 KiB: a bigger buffer is an mmap, mremap and munmap per read.
            return self.sock.recv(READ_SIZE, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None

    def close(self) -> None:
        self.sock.close()


def pair() -> tuple[socket.socket, socket.socket]:
    """(agent's end, kernel's end); the kernel's is inheritable, the agent's not."""
    agent, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    kernel.set_inheritable(True)
    # Room for a few large outputs in flight without the kernel blocking on every one.
    for s in (agent, kernel):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, 1 << 20)
            except OSError:
                pass
    return agent, kernel


"""The pipe between the agent and its kernel for the shell and IOPub channels.

Why not ZMQ: inside a gVisor sandbox on the ptrace platform every system call
costs ~0.04 ms, and a message over ZMQ ipc costs dozens of them on each side
(the sending thread wakes the I/O thread through its mailbox, the I/O thread
polls and writes, the receiving I/O thread reads and wakes the reader, and
libzmq checks ``getpid`` on every mailbox operation): 3-4 ms per message from
the kernel to the agent (docs/performance.md). Over this pipe a message is one
``send`` by the thread that made it and one ``recv`` by the agent's event loop.

One unix socketpair per kernel, inherited by the kernel as a descriptor. The
agent's end never blocks (``AgentEnd``): its event loop reads whatever has
arrived and forwards all of it to the gateway in one write, and what the
agent sends waits in a queue while the kernel is not reading (a long cell),
as it did in ZMQ's, so the agent goes on reading the gateway's stream
(interrupts, control, tunnels). The kernel's end blocks (``KernelEnd``): a
writer waits while the agent is behind instead of dropping, and an interrupt
never cuts a frame in two. Each message is
one frame: ``<channel:u8><body length:u32>`` then the body, a sequence of
``<part length:u32><part>``, the Jupyter message's parts as ZMQ would carry
them. Frames are written whole under a lock, so writers on several threads
never interleave.

Control, stdin and the heartbeat stay on ZMQ: they are off the hot path, and
ipykernel polls stdin with ``zmq.select``.
"""

from __future__ import annotations

import asyncio
import collections
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
    """The kernel's end: blocking sends of whole frames from any thread.

    A SIGINT (the agent's interrupt) that arrives while the main thread is in
    a send would raise KeyboardInterrupt out of ``sendall`` with part of the
    frame written, and the agent could not find the next one. ``guarded``
    says a main-thread send is under way: the kernel's SIGINT handler
    (``deferred_interrupt``) then only notes it, and the send raises
    KeyboardInterrupt once the frame is whole. Other threads never see
    Python's signal handlers run."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(True)
        self.lock = threading.Lock()
        self.guarded = False
        self.interrupted = False
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
        main = threading.current_thread() is threading.main_thread()
        with self.lock:
            self.guarded = main
            try:
                self.sock.sendall(data)
            finally:
                self.guarded = False
        if main and self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt

    def deferred_interrupt(self, signum, frame) -> None:
        """A SIGINT handler in place of ``signal.default_int_handler``."""
        if self.guarded:
            self.interrupted = True
            return
        raise KeyboardInterrupt

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


class AgentEnd:
    """The agent's end, written from the event loop and from the stdin thread
    (the shell fast path) without blocking either. A frame goes out at once
    when nothing is queued and the pipe has room; the rest waits in a queue,
    in order, which the event loop sends as the kernel reads. Past LIMIT
    queued bytes the event loop's writers wait for room (``room``) and the
    stdin thread hands its frames to the loop (``full``)."""

    LIMIT = 64 << 20

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop):
        self.sock = sock
        sock.setblocking(False)
        self.fd = sock.fileno()
        self.loop = loop
        self.lock = threading.Lock()  # nothing under it blocks
        self.queue: collections.deque[memoryview] = collections.deque()
        self.queued = 0
        self.armed = False  # the loop is watching for room
        self.closed = False
        self.roomy = asyncio.Event()
        self.roomy.set()

    @property
    def full(self) -> bool:
        return self.queued > self.LIMIT

    def write(self, data: bytes) -> None:
        """A whole frame, from any thread. Raises OSError (BrokenPipeError)
        once the kernel's end is closed or this one is."""
        with self.lock:
            if self.closed:
                raise BrokenPipeError("the kernel's pipe is closed")
            view = memoryview(data)
            if not self.queue:
                try:
                    view = view[self.sock.send(view):]
                except BlockingIOError:
                    pass
                if not view:
                    return
            self.queue.append(view)
            self.queued += len(view)
            if self.full:
                self.loop.call_soon_threadsafe(self.roomy.clear)
            if self.armed:
                return
            self.armed = True
        self.loop.call_soon_threadsafe(self._arm)

    async def room(self) -> None:
        """Until the queue is under LIMIT (the event loop's writers)."""
        while self.full and not self.closed:
            self.roomy.clear()
            await self.roomy.wait()

    def _arm(self) -> None:
        if not self.closed:
            self.loop.add_writer(self.fd, self._drain)

    def _drain(self) -> None:
        with self.lock:
            while self.queue:
                head = self.queue[0]
                try:
                    n = self.sock.send(head)
                except BlockingIOError:
                    break
                except OSError:  # the kernel is gone: what was queued for it goes too
                    self.queue.clear()
                    self.queued = 0
                    break
                self.queued -= n
                if n == len(head):
                    self.queue.popleft()
                else:
                    self.queue[0] = head[n:]
            done = not self.queue
            if done:
                self.armed = False
            roomy = not self.full
        if done:
            self.loop.remove_writer(self.fd)
        if roomy:
            self.roomy.set()

    def close(self) -> None:
        """On the event loop's thread."""
        with self.lock:
            self.closed = True
            self.queue.clear()
            self.queued = 0
            armed, self.armed = self.armed, False
        if armed:
            self.loop.remove_writer(self.fd)
        self.roomy.set()
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


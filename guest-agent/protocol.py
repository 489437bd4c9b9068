"""The one wire protocol between the gateway and the guest agent.

Both sides import this module: the gateway with pydantic 2 from PyPI, the
guest with Debian's python3-pydantic (1.10 on bookworm), so it uses only the
subset of pydantic the two share (plain BaseModel fields, no validators).

A frame is::

    u32 BE header length | u32 BE payload length | header (UTF-8 JSON) | payload

The header is one of the models below, told apart by its ``type`` field. The
payload carries bulk bytes untouched (kernel message parts, file contents,
command output), so nothing binary is ever base64-encoded and a kernel
message crosses without being parsed. Works on any reliable byte stream:
stdio pipes (gVisor), virtio-serial, vsock or a unix socket. See
docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel

VERSION = 1
PREFIX = struct.Struct(">II")
MAX_HEADER = 1 << 20  # a header is metadata only
MAX_PAYLOAD = 256 << 20  # a kernel message or file bigger than this is refused

KERNEL_CHANNELS = ("shell", "iopub", "stdin", "control")


class ProtocolError(Exception):
    """The stream carried something that is not a valid frame."""


class KernelFrame(BaseModel):
    """One Jupyter message. ``parts`` are the byte lengths of the payload's
    slices: header, parent_header, metadata, content, then each buffer."""

    type: Literal["kernel"] = "kernel"
    channel: Literal["shell", "iopub", "stdin", "control"]
    parts: List[int]
    # Opt-in spans (SANDGATE_TRACE, gateway/trace.py): wall-clock times of this
    # message (and of the request it answers) at each hop. Absent unless a
    # gateway that traces asked for them; old peers ignore the field.
    trace: Optional[Dict[str, float]] = None


class RequestFrame(BaseModel):
    """Gateway -> agent. ``args`` is validated against the op's model in
    OP_ARGS by the agent; the payload is op-specific (file bytes to write)."""

    type: Literal["request"] = "request"
    id: int
    op: str
    args: Dict[str, Any] = {}


class ResponseFrame(BaseModel):
    """Agent -> gateway, answering the request with the same id."""

    type: Literal["response"] = "response"
    id: int
    ok: bool = True
    error: Optional[str] = None
    result: Dict[str, Any] = {}


class EventFrame(BaseModel):
    """Agent -> gateway, unsolicited: ready, kernel_died, kernel_restarted,
    dropped (messages lost while detached, past the buffer bound)."""

    type: Literal["event"] = "event"
    event: Literal["ready", "kernel_died", "kernel_restarted", "dropped"]
    data: Dict[str, Any] = {}


class TunnelFrame(BaseModel):
    """One egress connection carried over the stream (guest-agent/tunnel.py).

    ``conn`` is the connection's id, chosen by the agent when a client inside
    connects to its listener. ``op``: ``open`` (agent -> gateway: a client
    connected), ``data`` (either way; the payload is the bytes), ``ack`` (either
    way: ``n`` more bytes of the other side's data were written on, so it may
    send that much more), ``eof`` (either way: that side will send no more
    data), ``close`` (either way: the connection is over, ``error`` says why
    if it failed). Each side may have at most ``WINDOW`` bytes of data unacked."""

    type: Literal["tunnel"] = "tunnel"
    conn: int
    op: Literal["open", "data", "ack", "eof", "close"]
    n: int = 0
    error: Optional[str] = None


Frame = Union[KernelFrame, RequestFrame, ResponseFrame, EventFrame, TunnelFrame]
_BY_TYPE = {"kernel": KernelFrame, "request": RequestFrame, "response": ResponseFrame, "event": EventFrame,
            "tunnel": TunnelFrame}


# Arguments of each request op. Paths are relative to the workspace.
class PathArgs(BaseModel):
    path: str = ""


class ReadArgs(BaseModel):
    """``length`` bytes from ``offset`` (the gateway reads a file a chunk at a time); 0: the whole
    file, up to MAX_PAYLOAD, as before ranges."""

    path: str = ""
    offset: int = 0
    length: int = 0


class WriteArgs(BaseModel):
    path: str
    mode: int = 0o644


class WritePartArgs(BaseModel):
    """One chunk of a file written in chunks: appended at ``offset`` to the upload's temporary
    file, which the ``last`` chunk renames over ``path``; ``abort`` removes it instead."""

    path: str
    upload: str
    offset: int = 0
    last: bool = False
    abort: bool = False
    mode: int = 0o644


class ExecArgs(BaseModel):
    argv: List[str]
    timeout: float = 60.0
    cwd: str = ""


class NoArgs(BaseModel):
    pass


class EgressArgs(BaseModel):
    """Egress through the stream: the agent listens on 127.0.0.1:``port`` and
    carries each connection to the gateway's proxy; ``port`` None turns it off.
    ``ca_pem``: the proxy's CA certificate, added to a bundle the sandbox's
    TLS clients are pointed at."""

    port: Optional[int] = None
    ca_pem: str = ""


class SetupArgs(BaseModel):
    env: Dict[str, str] = {}
    reseed_numpy: bool = True
    entropy: str = ""  # as in ReconnectArgs


class ReconnectArgs(BaseModel):
    clock: Optional[float] = None  # the host's time: a VM's clock stood still while it was saved
    entropy: str = ""  # hex from the host's CSPRNG: copies of one checkpoint must not share a random state
    # The sandbox's egress after the restore (None: off). The listener was
    # closed before the checkpoint (`quiesce`); this reopens it, or not.
    egress: Optional[EgressArgs] = None
    # `setup` in the same request (a fork, a start from a checkpoint): one
    # round trip fewer, and its cell runs while the kernel's liveness is
    # checked. The reply then says "setup": true (or false, with
    # "setup_error"); an agent from before ignores the field and says
    # neither, and the gateway sends `setup`.
    setup: Optional[SetupArgs] = None


OP_ARGS = {
    "ping": NoArgs,  # -> {kernel_alive, kernel_responding, pid, buffered, agent_version}
    "reconnect": ReconnectArgs,  # after a restore: set the clock, check (or renew) kernel sockets
    "setup": SetupArgs,  # after a restore: set env in agent and kernel, reseed randomness
    "interrupt": NoArgs,  # SIGINT the kernel
    "restart": NoArgs,  # kill and start the kernel again, same sandbox
    # payload of the response = file bytes; with a length: {size, total, file}, ``file`` naming the
    # file's identity and version (inode, mtime), so the reader of chunks knows it did not change
    "file_read": ReadArgs,
    "file_write": WriteArgs,  # payload of the request = file bytes
    "file_write_part": WritePartArgs,  # payload = the chunk; -> {size}: the bytes written so far
    "file_list": PathArgs,  # -> {entries: [{name, type, size, mtime}]}
    "file_delete": PathArgs,
    "exec": ExecArgs,  # -> {exit_code, stdout_len}; payload = stdout + stderr
    "sync": NoArgs,  # flush every file system's dirty pages to disk (before a VM's disk is checkpointed)
    "egress": EgressArgs,  # open, change or close the egress listener; -> {port, env}
    "quiesce": NoArgs,  # before a checkpoint: close the egress listener and every tunnelled connection
}


def dump(model: BaseModel) -> Dict[str, Any]:
    fn = getattr(model, "model_dump", None) or model.dict
    return fn()


def encode(header: BaseModel, payload: bytes = b"") -> bytes:
    d = dump(header)
    if "trace" in d and d["trace"] is None:  # untraced frames stay as they were
        del d["trace"]
    h = json.dumps(d, separators=(",", ":")).encode()
    if len(h) > MAX_HEADER or len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"frame too large: header {len(h)} B, payload {len(payload)} B")
    return PREFIX.pack(len(h), len(payload)) + h + payload


def encode_kernel(channel: str, parts: List[bytes], trace: Optional[Dict[str, float]] = None) -> bytes:
    return kernel_head(channel, parts, trace) + b"".join(parts)


def kernel_head(channel: str, parts: List[bytes], trace: Optional[Dict[str, float]] = None) -> bytes:
    """A kernel frame's prefix and header; the parts follow as they are (not copied into one payload)."""
    d = dump(KernelFrame(channel=channel, parts=[len(p) for p in parts], trace=trace))
    if d.get("trace") is None:
        d.pop("trace", None)
    h = json.dumps(d, separators=(",", ":")).encode()
    plen = sum(len(p) for p in parts)
    if len(h) > MAX_HEADER or plen > MAX_PAYLOAD:
        raise ProtocolError(f"frame too large: header {len(h)} B, payload {plen} B")
    return PREFIX.pack(len(h), plen) + h


def parse_header(raw: bytes) -> Frame:
    try:
        d = json.loads(raw)
        model = _BY_TYPE[d["type"]]
        return model(**d)
    except ProtocolError:
        raise
    except Exception as e:  # json, KeyError, TypeError, pydantic ValidationError
        raise ProtocolError(f"bad frame header: {e}") from None


def split_parts(frame: KernelFrame, payload: bytes) -> List[bytes]:
    if sum(frame.parts) != len(payload) or len(frame.parts) < 4:
        raise ProtocolError("kernel frame parts do not match its payload")
    out, pos = [], 0
    for n in frame.parts:
        out.append(payload[pos:pos + n])
        pos += n
    return out


async def read_frame(reader: asyncio.StreamReader) -> Tuple[Frame, bytes]:
    """Read one frame; raises EOFError at a clean end of stream."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise EOFError from None
        raise ProtocolError("stream ended inside a frame prefix") from None
    hlen, plen = PREFIX.unpack(prefix)
    if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise ProtocolError(f"frame too large: header {hlen} B, payload {plen} B")
    try:
        raw = await reader.readexactly(hlen)
        payload = await reader.readexactly(plen) if plen else b""
    except asyncio.IncompleteReadError:
        raise ProtocolError("stream ended inside a frame") from None
    return parse_header(raw), payload

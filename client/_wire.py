"""What the sync and async kernel websockets share: the two Jupyter frame formats
(legacy JSON, and the ``v1.kernel.websocket.jupyter.org`` binary subprotocol), and the
collection of one request's output and reply (``Collector``). The connections only move frames.

What the gateway shares with the SDK (the v1 frame layout, iopub output as a dict) lives in
``sandgate_wire`` (client/wire/); the gateway's decoding, with its checks on untrusted frames, is gateway/api/wire.py."""

from __future__ import annotations

import json
import struct
import time
import uuid
from typing import Any, Callable, List, Optional, Union

from . import _api as api
from .errors import SandboxDied
from .models import Execution, ExecutionError
from sandgate_wire import ABORTED, V1, output_of, pack_v1
PROTOCOLS = ("legacy", "v1")


def check_protocol(protocol: str) -> Optional[List[str]]:
    """The subprotocols to ask for: none for legacy, [V1] for v1."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
    return [V1] if protocol == "v1" else None


def header(msg_type: str, session: str) -> dict:
    return {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": session, "username": "sandgate-client",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime()), "version": "5.3"}


def encode(protocol: str, channel: str, header: dict, parent: Optional[dict], content: dict,
           metadata: Optional[dict] = None, buffers: Optional[List[bytes]] = None) -> Union[str, bytes]:
    """One message as a frame: a JSON text frame (legacy, no buffers) or binary."""
    if protocol == "v1":
        parts = [json.dumps(x).encode() for x in (header, parent or {}, metadata or {}, content)] + list(buffers or [])
        return pack_v1(channel, parts)
    msg = json.dumps({"header": header, "parent_header": parent or {}, "metadata": metadata or {},
                      "content": content, "channel": channel})
    if not buffers:
        return msg
    # Legacy with buffers: big-endian u32 count and offsets, the JSON, then each buffer.
    chunks = [msg.encode()] + list(buffers)
    offsets, at = [], 4 * (len(chunks) + 1)
    for c in chunks:
        offsets.append(at)
        at += len(c)
    return struct.pack(f"!{len(chunks) + 1}I", len(chunks), *offsets) + b"".join(chunks)


def decode(protocol: str, data: Union[str, bytes]) -> dict:
    """A frame as a message dict: ``channel``, ``header``, ``msg_type``, ``parent_header``,
    ``metadata``, ``content``, ``buffers`` (bytes)."""
    if protocol == "v1" and isinstance(data, bytes):
        n = struct.unpack_from("<Q", data)[0]
        offs = struct.unpack_from(f"<{n}Q", data, 8)
        channel = data[offs[0]:offs[1]].decode()
        parts = [data[offs[i]:offs[i + 1]] for i in range(1, n - 1)]  # the last offset is the frame's end
        head, parent, meta, content = (json.loads(p) for p in parts[:4])
        return {"channel": channel, "header": head, "msg_type": head.get("msg_type"), "parent_header": parent,
                "metadata": meta, "content": content, "buffers": parts[4:]}
    buffers: List[bytes] = []
    if isinstance(data, bytes):  # legacy with buffers: the JSON is chunk 0
        n = struct.unpack_from("!I", data)[0]
        offsets = list(struct.unpack_from(f"!{n}I", data, 4)) + [len(data)]
        chunks = [data[offsets[i]:offsets[i + 1]] for i in range(n)]
        data, buffers = chunks[0], chunks[1:]
    msg = json.loads(data)
    msg.setdefault("msg_type", (msg.get("header") or {}).get("msg_type"))
    msg["buffers"] = buffers
    return msg


class Collector:
    """One request's messages, fed as they come (``feed``) until its reply and the
    kernel's idle status have both arrived; ``finish`` makes the Execution."""

    def __init__(self, kernel_id: str, msg_id: str, cb: Optional[api.Callbacks],
                 on_input: Optional[Callable[[str, bool], Any]] = None):
        self.kernel_id, self.msg_id = kernel_id, msg_id
        self.cb = cb or api.Callbacks()
        self.on_input = on_input
        self.reply: Optional[dict] = None
        self.idle = False
        self.interrupted = False

    @property
    def done(self) -> bool:
        return self.reply is not None and self.idle

    def feed(self, m: dict) -> Optional[dict]:
        """Take one message; an ``input_request`` of this request is returned (the
        connection answers it with ``on_input``), anything else None."""
        if (m.get("parent_header") or {}).get("msg_id") != self.msg_id:
            return None
        self.cb.live.messages.append(m)
        t, c = m.get("msg_type") or m["header"]["msg_type"], m.get("content") or {}
        if t == "execute_reply":
            self.reply = c
        elif t == "status":
            if c.get("execution_state") == "dead":
                err = SandboxDied(f"kernel {self.kernel_id} is dead", code="conflict", state="dead")
                err.execution = self.cb.live
                raise err
            self.idle = c.get("execution_state") == "idle"
        elif t == "input_request":
            return m
        else:
            out = output_of(t, c)
            if out:
                self.cb.output(out)
        return None

    def finish(self, timeout: float) -> Execution:
        ex = self.cb.live
        ex.reply = self.reply
        if self.interrupted:
            ex.status = "timeout"
            return api.finish(ex, timeout)
        reply = self.reply
        ex.execution_count = reply.get("execution_count")
        ex.status = {"error": "error", "aborted": "aborted"}.get(reply.get("status"), "ok")
        if ex.status == "aborted":  # ipykernel dropped it: an earlier cell failed or was interrupted
            ex.error = ExecutionError("Aborted", ABORTED)
        if reply.get("status") == "error" and ex.error is None:
            ex.error = ExecutionError(reply.get("ename", ""), reply.get("evalue", ""), reply.get("traceback", []))
        self.cb.ended(ex)
        return api.finish(ex, timeout)


def execute_content(code: str, allow_stdin: bool) -> dict:
    return {"code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": allow_stdin, "stop_on_error": True}

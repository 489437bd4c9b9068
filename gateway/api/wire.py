"""Jupyter's two websocket wire formats, converted to and from message parts.

Internally a message is ``(channel, [header, parent_header, metadata,
content, *buffers])`` with each part the kernel's own JSON bytes, so the v1
subprotocol forwards kernel output without parsing it at all.

* legacy: a JSON text frame ``{"channel", "header", "parent_header",
  "metadata", "content", "buffers": []}``; with buffers, a binary frame of
  big-endian u32 count and offsets, the JSON, then the buffers.
* ``v1.kernel.websocket.jupyter.org``: little-endian u64 count n, n u64
  offsets; bytes [o0, o1) are the channel name, then each part in turn.
"""

from __future__ import annotations

import json
import struct
from typing import List, Tuple, Union

from sandgate_wire import V1, pack_v1
CLIENT_CHANNELS = ("shell", "control", "stdin")
Parts = List[bytes]


class WireError(ValueError):
    """A client frame that is not a Jupyter message."""


def _check(channel: str, parts: Parts) -> Tuple[str, Parts, dict]:
    if channel not in CLIENT_CHANNELS:
        raise WireError(f"no such channel: {channel!r}")
    if len(parts) < 4:
        raise WireError("a message needs header, parent_header, metadata and content")
    try:
        header = json.loads(parts[0])
        for p in parts[1:4]:
            if not isinstance(json.loads(p), dict):
                raise WireError("parent_header, metadata and content must be JSON objects")
    except (ValueError, UnicodeDecodeError):
        raise WireError("message parts are not JSON") from None
    if not isinstance(header, dict) or not header.get("msg_type") or not header.get("msg_id"):
        raise WireError("header needs msg_id and msg_type")
    return channel, parts, header


def decode_v1(data: Union[bytes, str]) -> Tuple[str, Parts, dict]:
    if isinstance(data, str):
        raise WireError("the v1 protocol carries binary frames only")
    try:
        n = struct.unpack_from("<Q", data)[0]
        if n < 2 or 8 * (n + 1) > len(data):
            raise WireError("bad offset table")
        offsets = struct.unpack_from(f"<{n}Q", data, 8)
    except struct.error:
        raise WireError("frame too short") from None
    if list(offsets) != sorted(offsets) or offsets[-1] > len(data) or offsets[0] != 8 * (n + 1):
        raise WireError("bad offset table")
    channel = data[offsets[0]:offsets[1]].decode("utf-8", "replace")
    parts = [data[offsets[i]:offsets[i + 1]] for i in range(1, n - 1)]
    return _check(channel, parts)


# The layout is the SDK's too: one definition for both sides.
encode_v1 = pack_v1


def decode_legacy(data: Union[bytes, str]) -> Tuple[str, Parts, dict]:
    buffers: List[bytes] = []
    try:
        if isinstance(data, bytes):
            n = struct.unpack_from("!I", data)[0]
            offsets = list(struct.unpack_from(f"!{n}I", data, 4)) + [len(data)]
            chunks = [data[offsets[i]:offsets[i + 1]] for i in range(n)]
            data, buffers = chunks[0].decode(), chunks[1:]
        msg = json.loads(data)
    except (ValueError, struct.error, UnicodeDecodeError, IndexError):
        raise WireError("not a JSON Jupyter message") from None
    if not isinstance(msg, dict):
        raise WireError("a message must be a JSON object")
    parts = [json.dumps(msg.get(k, {})).encode() for k in ("header", "parent_header", "metadata", "content")]
    return _check(msg.get("channel", "shell"), parts + buffers)


def encode_legacy(channel: str, parts: Parts) -> Union[str, bytes]:
    header = json.loads(parts[0])
    msg = {"header": header, "msg_id": header.get("msg_id"), "msg_type": header.get("msg_type"),
           "parent_header": json.loads(parts[1]), "metadata": json.loads(parts[2]),
           "content": json.loads(parts[3]), "buffers": [], "channel": channel}
    text = json.dumps(msg)
    buffers = parts[4:]
    if not buffers:
        return text
    chunks = [text.encode()] + list(buffers)
    offsets = [4 * (len(chunks) + 1)]
    for c in chunks[:-1]:
        offsets.append(offsets[-1] + len(c))
    return struct.pack(f"!{len(chunks) + 1}I", len(chunks), *offsets) + b"".join(chunks)

"""The parts of the Jupyter message formats that the SDK and the gateway share: the
``v1.kernel.websocket.jupyter.org`` binary frame layout, and an iopub message as the
sandbox API's output dict. Both import these from here, so the two sides cannot drift apart.

A package of its own (``sandgate_wire``), standard library only, so that the gateway does
not import the SDK, nor the SDK the gateway; it ships beside the SDK in client/."""

from __future__ import annotations

import struct
from typing import List, Optional, Sequence

V1 = "v1.kernel.websocket.jupyter.org"


def pack_v1(channel: str, parts: Sequence[bytes]) -> bytes:
    """A v1 frame: little-endian u64 count and offsets (channel, each part, the end), then the bytes."""
    ch = channel.encode()
    offsets: List[int] = [8 * (len(parts) + 3)]
    offsets.append(offsets[-1] + len(ch))
    for p in parts:
        offsets.append(offsets[-1] + len(p))
    return struct.pack(f"<{len(offsets) + 1}Q", len(offsets), *offsets) + ch + b"".join(parts)


# What a request ipykernel did not run says (stop_on_error: the cell before it failed or was interrupted).
ABORTED = "the kernel did not run this cell: a cell ahead of it in the kernel's queue failed or was interrupted"


def output_of(msg_type: str, content: dict) -> Optional[dict]:
    """A Jupyter iopub message as the sandbox API's output dict; None for what is not output."""
    if msg_type == "stream":
        return {"type": "stream", "name": content.get("name"), "text": content.get("text", "")}
    if msg_type in ("execute_result", "display_data"):
        return {"type": msg_type, "data": content.get("data", {}), "metadata": content.get("metadata", {})}
    if msg_type == "error":
        return {"type": "error", "ename": content.get("ename"), "evalue": content.get("evalue"),
                "traceback": content.get("traceback", [])}
    return None
